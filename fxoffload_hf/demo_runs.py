"""The demo's timed runs: the checkpoint loaded eagerly or offloaded, each in a process of its own (so
that neither run's memory is counted in the other's), prefill and greedy decoding timed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def run_generation(
    mode: str, folder: str, budget: int | None, new_tokens: int, prompt_len: int = 32
) -> dict[str, Any]:
    """Load ``folder`` eagerly or offloaded, then time prefill and greedy decoding; figures as a dict."""
    import torch
    import transformers

    import fxoffload_hf
    from fxoffload_hf.memory import PeakSampler, process_status

    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, prompt_len))
    # dynamo's one-time import and set-up cost is not the model's: pay it before the baseline
    torch.compile(lambda x: x + 1, backend="eager")(ids)
    base = process_status(("RssAnon", "RssFile"))
    start = time.perf_counter()
    if mode == "eager":
        model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    else:
        # the demo shows the streamed schedule: captured at the warm-up, not deferred past it
        model = fxoffload_hf.from_pretrained(folder, cpu_memory=budget, device="cpu", capture="first-call")
    load_seconds = time.perf_counter() - start
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)  # warm-up: capture and profile
        model(ids)
        with PeakSampler() as sampler:
            start = time.perf_counter()
            model(ids)
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            tokens = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
            decode = time.perf_counter() - start
    result = {
        "mode": mode,
        "load_seconds": round(load_seconds, 3),
        "prefill_seconds": round(prefill, 4),
        "decode_tokens_per_second": round(new_tokens / decode, 3),
        "peak_private_bytes": sampler.peak["RssAnon"] - base["RssAnon"],
        "peak_file_backed_bytes": sampler.peak["RssFile"] - base["RssFile"],
        "tokens": tokens[0].tolist(),
    }
    if mode != "eager":
        result.update(fxoffload_hf.engine_of(model).report())
    return result


def run_in_child(mode: str, folder: Path, budget: int | None, new_tokens: int) -> dict[str, Any]:
    """``run_generation`` in a process of its own (``fxoffload-hf _run``): its figures."""
    cmd = [
        sys.executable,
        "-m",
        "fxoffload_hf.cli",
        "_run",
        mode,
        str(folder),
        str(budget or 0),
        str(new_tokens),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} run failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
