"""Child process of test_memory_budget: load a checkpoint under a CPU budget and report peak memory."""

from __future__ import annotations

import gc
import json
import os
import sys

import torch

import fxoffload_hf
from fxoffload_hf.memory import PeakSampler, process_status, reset_peak_rss


def main() -> None:
    path, warmup_path, share = sys.argv[1], sys.argv[2], float(sys.argv[3])
    torch.set_num_threads(2)
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    # imports and dynamo's own first-use costs are not the model's: pay them on a tiny model first
    warm = fxoffload_hf.from_pretrained(warmup_path, cpu_memory="1GiB", device="cpu")
    with torch.no_grad():
        warm.generate(ids, max_new_tokens=3, do_sample=False)
    fxoffload_hf.restore(warm)
    del warm
    gc.collect()
    total = sum(
        os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")
    )
    budget = int(total * share)
    reset_peak_rss()
    base = process_status()
    with PeakSampler(every=0.005) as sampler:
        model = fxoffload_hf.from_pretrained(path, cpu_memory=budget, device="cpu")
        # Transformers reads every tensor once to index the checkpoint, through its own mappings of the
        # shards: clean file pages, mapped for a moment and dropped (``integrations.transformers``); the
        # run's peak is measured from here, the load's by what it allocates
        loaded = process_status()
        reset_peak_rss()
        with torch.no_grad():
            tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    end = process_status()
    engine = fxoffload_hf.engine_of(model)
    report = {
        "checkpoint_bytes": total,
        "budget": budget,
        "peak_rise": end["VmHWM"] - base["VmRSS"],
        "load_anon_rise": loaded["RssAnon"] - base["RssAnon"],
        "anon_rise": end["RssAnon"] - base["RssAnon"],
        "peak_anon_rise": sampler.peak["RssAnon"] - base["RssAnon"],
        "disk_bytes": engine.store.bytes_in(fxoffload_hf.weight_record.Tier.DISK),
        "tokens": tokens.tolist(),
        "graphs": len(engine.runners),
        "eager_calls": engine.stats.eager_calls,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
