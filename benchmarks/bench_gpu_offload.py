"""GPU benchmark: eager on the GPU, fxoffload at 25% of the model in GPU memory, accelerate's CPU offload.

Prints a table and writes JSON. Targets (issue 6): step time within 10% of max(compute, copy);
fxoffload >= 3x accelerate's tokens/s at the same budget; host RAM <= 1.1x the model's bytes.

    python benchmarks/bench_gpu_offload.py [--size-gb 2] [--new-tokens 32] [--out results.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import transformers
from harness import engine, model, report, targets

import fxoffload_hf


def build_checkpoint(size_gb: float, folder: Path) -> int:
    """A random-init bf16 Llama of about ``size_gb`` GB, saved as sharded safetensors; returns its bytes."""
    config = model.llama_config(
        size_gb, vocab=32000, hidden=2048, intermediate=5632, heads=16, dtype="bfloat16", min_layers=2
    )
    built = model.build(folder, config, device="cuda", shard_size="1GB")
    torch.cuda.empty_cache()
    return built["bytes"]


def h2d_bandwidth() -> float:
    """Bytes per second of a pinned host-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() / (time.perf_counter() - start)


def decode(lm: Any, ids: torch.Tensor, new_tokens: int) -> dict[str, Any]:
    """Warm up, then time a greedy generate of ``new_tokens``: rate, step time, peak GPU and host memory."""
    with torch.no_grad():
        lm.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up: capture, profile, schedule
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        out = lm.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "tokens_per_second": round(new_tokens / seconds, 3),
        "step_seconds": round(seconds / new_tokens, 5),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
        "host_rss_bytes": psutil.Process().memory_info().rss,
        "tokens": out[0].tolist(),
    }


def forward_logits(lm: Any, sequence: torch.Tensor) -> torch.Tensor:
    """Logits of one forward over ``sequence`` (teacher-forced), on the host in fp32."""
    with torch.no_grad():
        return lm(sequence).logits[0].float().cpu()


def compare_logits(expected: torch.Tensor, got: torch.Tensor, prompt_len: int) -> dict[str, Any]:
    """Where offloaded logits part from eager's on the same tokens: the largest difference, the first
    position whose greedy token differs, and eager's margin between its two best tokens there (a small
    margin: a near tie that rounding flipped; a large one: a fault)."""
    generated = slice(prompt_len - 1, expected.shape[0])
    differs = (expected[generated].argmax(-1) != got[generated].argmax(-1)).nonzero()
    first = int(differs[0]) if len(differs) else None
    margin = None
    if first is not None:
        top2 = expected[prompt_len - 1 + first].topk(2).values
        margin = float(top2[0] - top2[1])
    return {
        "max_abs_diff": float((expected - got).abs().max()),
        "bit_exact": bool(torch.equal(expected, got)),
        "first_token_that_differs": first,
        "eager_top2_margin_there": margin,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gb", type=float, default=2.0, help="model size in GB (bf16), default 2")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated in the timed run")
    parser.add_argument("--share", type=float, default=0.25, help="GPU budget as a share of the model")
    parser.add_argument(
        "--attn",
        default=None,
        help="attn_implementation for every mode (e.g. 'eager': no SDPA kernel choice, to tell whether a "
        "token difference comes from SDPA taking another kernel under capture)",
    )
    parser.add_argument("--out", default="bench_results/bench_gpu_offload.json", help="JSON results file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_offload needs a CUDA device")
    folder = Path(tempfile.mkdtemp(prefix="fxoffload-gpu-bench-"))
    model_bytes = build_checkpoint(args.size_gb, folder)
    budget = int(model_bytes * args.share)
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(0)).cuda()
    results: dict[str, Any] = {}

    attn = {"attn_implementation": args.attn} if args.attn else {}
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **attn).cuda()
    results["eager"] = decode(eager, ids, args.new_tokens)
    sequence = torch.tensor([results["eager"]["tokens"]], device="cuda")
    eager_logits = forward_logits(eager, sequence)
    del eager
    gc.collect()
    torch.cuda.empty_cache()

    base_rss = psutil.Process().memory_info().rss
    offloaded = fxoffload_hf.from_pretrained(
        folder, gpu_memory=budget, cpu_memory=None, device="cuda", **attn
    )
    results["fxoffload"] = decode(offloaded, ids, args.new_tokens)
    teacher_forced = compare_logits(eager_logits, forward_logits(offloaded, sequence), ids.shape[1])
    figures = engine.engine_report(offloaded)
    assert figures is not None, "fxoffload_hf.from_pretrained returned a model it does not run"
    stats = figures["stats"]
    results["fxoffload"].update(stats, store=figures["store"], pieces=figures["pieces"])
    results["fxoffload"]["host_rss_rise_bytes"] = results["fxoffload"]["host_rss_bytes"] - base_rss
    streamed_per_step = stats["bytes_streamed"] / max(stats["calls"], 1)
    fxoffload_hf.restore(offloaded)
    del offloaded
    gc.collect()
    torch.cuda.empty_cache()

    print(
        f"fxoffload: {results['fxoffload']['tokens_per_second']} tok/s, eager {results['eager']['tokens_per_second']}"
    )
    # no Hub kernels: offline, transformers would fetch them for the layers it places on the GPU
    accelerate_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        dtype=torch.bfloat16,
        device_map="auto",
        max_memory={0: budget, "cpu": "200GiB"},
        use_kernels=False,
        **attn,
    )
    results["accelerate"] = decode(accelerate_model, ids, args.new_tokens)
    del accelerate_model

    bandwidth = h2d_bandwidth()
    compute = results["eager"]["step_seconds"]
    copy = streamed_per_step / bandwidth
    fx = results["fxoffload"]
    summary = {
        "model_bytes": model_bytes,
        "gpu_budget_bytes": budget,
        "h2d_bytes_per_second": bandwidth,
        "compute_step_seconds": compute,
        "copy_step_seconds": copy,
        "step_vs_bound": round(fx["step_seconds"] / max(compute, copy), 3),
        "fx_vs_accelerate_tokens": round(
            fx["tokens_per_second"] / results["accelerate"]["tokens_per_second"], 2
        ),
        "host_rss_rise_vs_model": round(fx["host_rss_rise_bytes"] / model_bytes, 3),
        "same_tokens": fx["tokens"] == results["eager"]["tokens"],
        "teacher_forced_vs_eager": teacher_forced,
    }
    header = ("mode", "tok/s", "step ms", "peak GPU MiB", "host RSS MiB")
    lines = [
        (mode, f"{r['tokens_per_second']:.2f}", f"{r['step_seconds'] * 1e3:.2f}")
        + (f"{r['peak_gpu_bytes'] / 2**20:.0f}", f"{r['host_rss_bytes'] / 2**20:.0f}")
        for mode, r in results.items()
    ]
    print("\n".join(report.aligned([header, *lines])))
    print(json.dumps(summary, indent=2))
    print("\ntargets:")
    checks = [
        targets.within("step time / max(compute, copy)", summary["step_vs_bound"], most=1.1),
        targets.within("tok/s fxoffload / accelerate", summary["fx_vs_accelerate_tokens"], least=3),
        targets.within("host RSS rise / model bytes", summary["host_rss_rise_vs_model"], most=1.1),
    ]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "machine": report.machine(),
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
        "summary": summary,
        "targets": checks,
    }
    report.write_json(Path(args.out), record)


if __name__ == "__main__":
    main()
