"""CPU streaming from one checkpoint written two ways: its tensors at 16-byte-aligned offsets (used in place
from the mapped file) and 8 bytes off (read into the staging arena at each use, since some of ATen's
kernels round by alignment). Decode tokens/s, the two interleaved in one process, and their ratio.

    python benchmarks/bench_alignment.py [--size-gb 0.5] [--vocab 32000] [--budget-share 0.25] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import model, report

import fxoffload_hf
from fxoffload_hf.align import align_shards_in_place


def decode(folder: Path, budget: int, ids: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Load ``folder`` offloaded at ``budget``, warm up, then time a greedy generate of ``new_tokens``."""
    lm = fxoffload_hf.from_pretrained(folder, cpu_memory=budget, device="cpu", capture="first-call")
    try:
        with torch.no_grad():
            lm.generate(ids, max_new_tokens=4, do_sample=False)  # capture, profile, schedule
            start = time.perf_counter()
            out = lm.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            seconds = time.perf_counter() - start
        store = fxoffload_hf.engine_of(lm).store
        return {
            "tokens_per_second": new_tokens / seconds,
            "in_place_share": sum(r.in_place for r in store.weights()) / len(store.weights()),
            "tokens": out[0].tolist(),
        }
    finally:
        fxoffload_hf.restore(lm)
        del lm
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gb", type=float, default=0.5, help="model size in GB (fp32)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    parser.add_argument(
        "--budget-share", type=float, default=0.25, help="cpu_memory as a share of the weights"
    )
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated in each timed run")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median kept)")
    parser.add_argument("--out", default="bench_results/bench_alignment.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fxoffload-alignment-"))
    try:
        folders = {"aligned": work / "aligned", "8 bytes off": work / "off"}
        built = model.build(folders["aligned"], model.llama_config(args.size_gb, vocab=args.vocab))
        shutil.copytree(folders["aligned"], folders["8 bytes off"])
        for remainder, folder in zip((0, 8), folders.values(), strict=True):
            align_shards_in_place(folder, data_start=remainder)
        budget = int(built["bytes"] * args.budget_share)
        ids = torch.randint(0, args.vocab, (1, 32), generator=torch.Generator().manual_seed(0))
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in folders}
        for _ in range(args.rounds):
            for mode, folder in folders.items():
                runs[mode].append(decode(folder, budget, ids, args.new_tokens))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rates = {mode: statistics.median(r["tokens_per_second"] for r in rs) for mode, rs in runs.items()}
    header = ("checkpoint", "tok/s (median)", "weights used in place")
    lines = [(m, f"{rates[m]:.2f}", f"{runs[m][0]['in_place_share']:.0%}") for m in folders]
    print("\n".join(report.aligned([header, *lines])))
    ratio = rates["8 bytes off"] / rates["aligned"]
    same = len({tuple(r["tokens"]) for rs in runs.values() for r in rs}) == 1
    print(f"8 bytes off / aligned: {ratio:.2f}; tokens equal in every run: {same}")
    report.write_json(
        Path(args.out),
        {
            "date": time.strftime("%Y-%m-%d"),
            "machine": report.machine(),
            "model_bytes": built["bytes"],
            "budget_bytes": budget,
            "tokens_per_second": rates,
            "off_vs_aligned": round(ratio, 3),
            "same_tokens": same,
        },
    )


if __name__ == "__main__":
    main()
