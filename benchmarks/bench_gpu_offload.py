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


def profile_decode(lm: Any, ids: torch.Tensor, folder: Path, name: str) -> dict[str, float]:
    """Profile a warm greedy generate of 3 tokens (prefill and two decode steps) with torch.profiler:
    the op tables by host and device time and a Chrome trace under ``folder``; returns where the host
    time went (launching, waiting on the device, allocating) and how busy the device and copy engine were."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        lm.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    folder.mkdir(parents=True, exist_ok=True)
    for sort in ("self_cpu_time_total", "self_device_time_total"):
        (folder / f"{name}_profile_{sort}.txt").write_text(averages.table(sort_by=sort, row_limit=40))
    prof.export_chrome_trace(str(folder / f"{name}_profile.json.gz"))

    def host_ms(*keys: str) -> float:
        return sum(a.self_cpu_time_total for a in averages if any(k in a.key for k in keys)) / 1e3

    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in events if "Memcpy" in e.name]
    return {
        "wall_ms": round(wall * 1e3, 2),
        "host_sync_ms": round(host_ms("Synchronize", "cudaEventQuery"), 2),
        "host_launch_ms": round(host_ms("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync"), 2),
        "host_malloc_ms": round(host_ms("cudaMalloc", "cudaFree", "cudaHostRegister"), 2),
        "device_kernel_ms": round(sum(e.device_time for e in events if e not in copies) / 1e3, 2),
        "device_copy_ms": round(sum(e.device_time for e in copies) / 1e3, 2),
        "pageable_copies": sum("Pageable" in e.name for e in copies),
        "copies": len(copies),
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
    parser.add_argument(
        "--modes",
        default="eager,fxoffload,accelerate",
        help="comma-separated modes to run (eager always runs: it is the reference)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile 3 warm tokens of eager and fxoffload (tables and Chrome traces beside --out)",
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

    modes = {m.strip() for m in args.modes.split(",") if m.strip()}
    unknown = modes - {"eager", "fxoffload", "accelerate"}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from eager, fxoffload, accelerate")
    profiles = Path(args.out).parent / "profiles" if args.profile else None
    attn = {"attn_implementation": args.attn} if args.attn else {}
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, **attn).cuda()
    results["eager"] = decode(eager, ids, args.new_tokens)
    if profiles:
        results["eager"]["profile"] = profile_decode(eager, ids, profiles, "eager")
    sequence = torch.tensor([results["eager"]["tokens"]], device="cuda")
    eager_logits = forward_logits(eager, sequence)
    del eager
    gc.collect()
    torch.cuda.empty_cache()

    summary: dict[str, Any] = {"model_bytes": model_bytes, "gpu_budget_bytes": budget}
    if "fxoffload" in modes:
        base_rss = psutil.Process().memory_info().rss
        offloaded = fxoffload_hf.from_pretrained(
            folder, gpu_memory=budget, cpu_memory=None, device="cuda", capture="first-call", **attn
        )
        results["fxoffload"] = fx = decode(offloaded, ids, args.new_tokens)
        summary["teacher_forced_vs_eager"] = compare_logits(
            eager_logits, forward_logits(offloaded, sequence), ids.shape[1]
        )
        figures = engine.engine_report(offloaded)
        assert figures is not None, "fxoffload_hf.from_pretrained returned a model it does not run"
        stats = figures["stats"]
        fx.update(stats, store=figures["store"], pieces=figures["pieces"])
        fx["host_rss_rise_bytes"] = fx["host_rss_bytes"] - base_rss
        if profiles:
            fx["profile"] = profile_decode(offloaded, ids, profiles, "fxoffload")
        streamed_per_step = stats["bytes_streamed"] / max(stats["calls"], 1)
        fxoffload_hf.restore(offloaded)
        del offloaded
        gc.collect()
        torch.cuda.empty_cache()
        print(f"fxoffload: {fx['tokens_per_second']} tok/s, eager {results['eager']['tokens_per_second']}")
        bandwidth = h2d_bandwidth()
        compute = results["eager"]["step_seconds"]
        copy = streamed_per_step / bandwidth
        summary.update(
            h2d_bytes_per_second=bandwidth,
            compute_step_seconds=compute,
            copy_step_seconds=copy,
            step_vs_bound=round(fx["step_seconds"] / max(compute, copy), 3),
            host_rss_rise_vs_model=round(fx["host_rss_rise_bytes"] / model_bytes, 3),
            same_tokens=fx["tokens"] == results["eager"]["tokens"],
        )

    if "accelerate" in modes:
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
        if "fxoffload" in results:
            summary["fx_vs_accelerate_tokens"] = round(
                results["fxoffload"]["tokens_per_second"] / results["accelerate"]["tokens_per_second"], 2
            )

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
        targets.within(label, summary[key], **bound)
        for label, key, bound in (
            ("step time / max(compute, copy)", "step_vs_bound", {"most": 1.1}),
            ("tok/s fxoffload / accelerate", "fx_vs_accelerate_tokens", {"least": 3}),
            ("host RSS rise / model bytes", "host_rss_rise_vs_model", {"most": 1.1}),
        )
        if key in summary
    ]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "machine": report.machine(),
        "attn_implementation": args.attn,
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()},
        "summary": summary,
        "targets": checks,
    }
    report.write_json(Path(args.out), record)


if __name__ == "__main__":
    main()
