"""``fxoffload-hf``: demo, plan, generate, bench and align from the command line.

Exit codes: 0 success, 1 a run failed, 2 bad arguments or input (missing folder, corrupt checkpoint,
budget too small).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fxoffload_hf.tradeoff import Bandwidths

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def _budget_for(spec: str | None, model_bytes: int) -> int | None:
    """Budgets in the demo: a percentage is a share of the model's size (``25%``), else as ``offload``."""
    from fxoffload_hf.config import parse_budget

    if spec is None:
        return None
    if spec.strip().endswith("%"):
        return parse_budget(spec, free_bytes=model_bytes, what="--cpu-memory")
    return parse_budget(spec, what="--cpu-memory")


def cmd_demo(args: argparse.Namespace) -> int:
    from fxoffload_hf.demo import checkpoint_bytes, ensure_checkpoint
    from fxoffload_hf.demo_runs import run_in_child
    from fxoffload_hf.memory import format_bytes
    from fxoffload_hf.plan import plan_checkpoint

    folder = ensure_checkpoint(args.arch, args.size)
    total = checkpoint_bytes(folder)
    budget = _budget_for(args.cpu_memory, total)
    print(f"Checkpoint: {folder} ({format_bytes(total)}, RANDOM weights: the tokens mean nothing)")
    print(f"CPU budget: {format_bytes(budget)} ({args.cpu_memory} of the model)\n")
    plan = plan_checkpoint(folder, cpu_memory=budget, gpu_memory=args.gpu_memory, seq_len=32)
    print("Plan (from shapes alone, before anything runs):")
    print(plan.table() + "\n")
    runs = {}
    for mode in ("eager", "fxoffload"):
        print(f"Running {mode} ...", flush=True)
        runs[mode] = run_in_child(mode, folder, budget, args.max_new_tokens)
    eager, fx = runs["eager"], runs["fxoffload"]
    print()
    print(f"{'':24}{'eager (all in RAM)':>22}{'fxoffload':>22}")
    rows = [
        ("decode tokens/s", "decode_tokens_per_second", lambda v: f"{v:.2f}"),
        ("prefill seconds", "prefill_seconds", lambda v: f"{v:.3f}"),
        ("peak private memory", "peak_private_bytes", format_bytes),
        ("peak file-backed memory", "peak_file_backed_bytes", format_bytes),
    ]
    for label, key, fmt in rows:
        print(f"{label:24}{fmt(eager[key]):>22}{fmt(fx[key]):>22}")
    print(f"{'same tokens as eager':24}{'':>22}{str(eager['tokens'] == fx['tokens']):>22}")
    print(
        f"\nfxoffload: {fx['store']}; pieces per graph {fx['pieces']}; copy hidden behind compute "
        f"{fx['stats']['hidden_copy_share']:.0%}; streamed {format_bytes(fx['stats']['bytes_streamed'])}"
    )
    print(
        "Eager's weights are file-backed pages of the mapped checkpoint: under a real memory limit they are "
        "evicted and re-read (see benchmarks/bench_cpu_offload.py)."
    )
    return EXIT_OK if eager["tokens"] == fx["tokens"] else EXIT_FAILED


def cmd_align(args: argparse.Namespace) -> int:
    from fxoffload_hf.align import align_checkpoint

    print(f"aligned copy: {align_checkpoint(args.model_dir, args.out_dir)}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from fxoffload_hf.plan import plan_checkpoint

    bandwidths = Bandwidths(
        disk=args.disk_gbps * 1e9,
        link=args.link_gbps * 1e9,
        cpu_memory=args.cpu_bw_gbps * 1e9,
        gpu_memory=args.gpu_bw_gbps * 1e9,
    )
    report = plan_checkpoint(
        args.model_dir,
        gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory,
        device=args.device,
        batch=args.batch,
        seq_len=args.seq_len,
        bandwidths=bandwidths,
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())
    return EXIT_BAD_INPUT if report.error else EXIT_OK


def cmd_generate(args: argparse.Namespace) -> int:
    import torch
    import transformers

    import fxoffload_hf

    folder = Path(args.model_dir)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 - any failure means there is no usable tokenizer there
        print(
            f"error: {folder} has no tokenizer (tokenizer.json / tokenizer_config.json); save one with "
            "tokenizer.save_pretrained(MODEL_DIR)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    from fxoffload_hf.timeline import plot_timeline, record_timeline, write_chrome_trace

    if args.timeline or args.trace:
        if args.capture == "deferred":
            print(
                "error: --timeline and --trace draw the streamed schedule of captured calls; with --capture "
                "deferred a short answer runs eagerly and has none: leave out --capture or the timeline",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
        args.capture = "first-call"  # a timeline is of captured calls
    model = fxoffload_hf.from_pretrained(
        folder,
        gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory,
        device=args.device,
        capture=args.capture,
        compile_cache=args.compile_cache,
    )
    prompts = [tokenizer(prompt, return_tensors="pt") for prompt in args.prompt]
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    start = time.perf_counter()
    with torch.no_grad(), record_timeline(model) as events:
        if len(prompts) == 1:
            outputs = [_streamed(model, tokenizer, prompts[0], greedy)]
        else:  # one block: each weight streamed once per step for all prompts, each prompt as if alone
            calls = [functools.partial(model.generate, **inputs, **greedy) for inputs in prompts]
            outputs = fxoffload_hf.run_as_block(model, calls)
            for out in outputs:
                print(tokenizer.decode(out[0], skip_special_tokens=True), end="\n\n")
    seconds = time.perf_counter() - start
    if args.timeline:
        print(f"timeline: {plot_timeline(events, args.timeline)}", file=sys.stderr)
    if args.trace:
        print(
            f"trace: {write_chrome_trace(events, args.trace)} (open in https://ui.perfetto.dev)",
            file=sys.stderr,
        )
    new = sum(
        out.shape[-1] - inputs["input_ids"].shape[-1] for out, inputs in zip(outputs, prompts, strict=True)
    )
    if not args.quiet:
        print(f"\n[{new} tokens in {seconds:.2f} s, {new / seconds:.2f} tokens/s]", file=sys.stderr)
    return EXIT_OK


def _streamed(model: Any, tokenizer: Any, inputs: Any, greedy: dict[str, Any]) -> Any:
    """``model.generate`` of ``inputs``, its tokens printed as they come. A capture that stopped midway
    (``CallStoppedMidway``: a generate given a streamer is not run again by itself) starts the answer
    again, as eager calls, after saying so."""
    import transformers

    from fxoffload_hf.memory_model import CallStoppedMidway

    try:
        return model.generate(**inputs, **greedy, streamer=transformers.TextStreamer(tokenizer))
    except CallStoppedMidway:
        print("\n[capture stopped midway; the answer starts again, as eager calls]", file=sys.stderr)
    return model.generate(**inputs, **greedy, streamer=transformers.TextStreamer(tokenizer))


def cmd_bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_cpu_offload.py"
    if not script.exists():
        print(
            "error: benchmarks/bench_cpu_offload.py ships with the source tree; run from a checkout",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    return subprocess.call([sys.executable, str(script), "--model-dir", args.model_dir, *args.rest])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxoffload-hf", description=__doc__)
    parser.add_argument("--verbose", action="store_true", help="show tracebacks on errors")
    parser.add_argument("--quiet", action="store_true", help="print only results")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="generate with a random ~1 GB Llama under a 25%% CPU budget, beside eager"
    )
    demo.add_argument("--size", type=float, default=1.0, help="checkpoint size in GB (default 1)")
    demo.add_argument(
        "--arch", default="llama", choices=["llama", "qwen2", "mistral"], help="architecture (default llama)"
    )
    demo.add_argument(
        "--gpu-memory",
        default=None,
        help="GPU budget for the plan the demo prints (the demo runs on the CPU)",
    )
    demo.add_argument(
        "--cpu-memory", default="25%", help="bytes, a size, or a share of the model (default 25%%)"
    )
    demo.add_argument("--max-new-tokens", type=int, default=16, help="greedy new tokens (default 16)")
    demo.set_defaults(func=cmd_demo)

    plan = sub.add_parser(
        "plan",
        help="print the offload plan of a checkpoint without running it: pieces, the smallest budget and "
        "what sets it, predicted decode speed at budgets from there to all resident",
    )
    plan.add_argument("model_dir", help="checkpoint folder (only its config.json is read)")
    plan.add_argument(
        "--gpu-memory", default=None, help="GPU budget: bytes, a size ('24GiB') or a share ('80%%')"
    )
    plan.add_argument("--cpu-memory", default=None, help="host memory for weights: bytes, a size or a share")
    plan.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="plan for this device (cuda works without a GPU)",
    )
    plan.add_argument("--batch", type=int, default=1, help="sequences per forward (default 1)")
    plan.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    defaults = Bandwidths()
    for name, default, what in (
        ("disk", defaults.disk, "disk reads"),
        ("link", defaults.link, "host-to-GPU copies"),
        ("cpu-bw", defaults.cpu_memory, "the CPU reading the weights it computes with"),
        ("gpu-bw", defaults.gpu_memory, "the GPU reading the weights it computes with"),
    ):
        plan.add_argument(
            f"--{name}-gbps",
            type=float,
            default=default / 1e9,
            help=f"GB/s of {what}, for the predicted speed (default {default / 1e9:g}, assumed)",
        )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=cmd_plan)

    gen = sub.add_parser("generate", help="generate text from a local checkpoint, streaming tokens")
    gen.add_argument("model_dir", help="checkpoint folder with its tokenizer")
    gen.add_argument(
        "--prompt",
        required=True,
        action="append",
        help="text to continue; repeat it for several prompts, run as one block (each weight read once per "
        "step for all; each prompt's tokens as if it ran alone)",
    )
    gen.add_argument("--max-new-tokens", type=int, default=64, help="greedy new tokens (default 64)")
    gen.add_argument(
        "--gpu-memory", default=None, help="GPU budget: bytes, a size ('8GiB') or a share of free ('80%%')"
    )
    gen.add_argument(
        "--cpu-memory",
        default=None,
        help="host memory for weights: bytes, a size or a share; the rest on disk",
    )
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument(
        "--capture",
        default=None,
        choices=["first-call", "deferred"],
        help="deferred (the default, or $FXOFFLOAD_HF_CAPTURE): run eagerly until capture is worth its "
        "cost, so a short answer comes sooner; first-call: capture and plan at the first call (the "
        "default with --timeline or --trace)",
    )
    gen.add_argument(
        "--compile-cache",
        default=None,
        help="folder of the compile cache, or 'off' (default: $FXOFFLOAD_HF_COMPILE_CACHE, else "
        "~/.cache/fxoffload_hf/compiled): what is captured once is not captured again by the next run",
    )
    gen.add_argument("--timeline", default=None, help="write a PNG of copy and compute per piece over time")
    gen.add_argument("--trace", default=None, help="write the same as a Chrome trace (JSON) for Perfetto")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="eager vs fxoffload vs accelerate at the same CPU budget")
    bench.add_argument("model_dir")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    align = sub.add_parser(
        "align",
        help="copy a checkpoint with its shards' data aligned to 64 bytes, so that a CPU run uses every "
        "weight in place from the file instead of copying it at each use",
    )
    align.add_argument("model_dir", help="checkpoint folder (safetensors shards, config, tokenizer)")
    align.add_argument("out_dir", help="new folder for the aligned copy (must not exist)")
    align.set_defaults(func=cmd_align)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_run"]:  # a demo's timed run, in a process of its own (``demo_runs``)
        from fxoffload_hf.demo_runs import run_generation

        mode, folder, budget, tokens = argv[1:5]
        print(json.dumps(run_generation(mode, folder, int(budget) or None, int(tokens))))
        return EXIT_OK
    args = build_parser().parse_args(argv)
    if args.quiet or not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars only for a person at a terminal
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        if args.verbose:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - the command line reports, --verbose shows the traceback
        if args.verbose:
            raise
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


def run() -> None:
    """The ``fxoffload-hf`` command: ``main`` in a process of its own, exiting with its code."""
    # What is imported by now (torch, dynamo, Transformers: about a million objects) lives as long as the
    # process; frozen, the collector stops walking it at every full collection of the command's own
    # objects, which dynamo's tracing triggers often (0.4 s of a 70B plan's 5.7), and at exit (0.5 s more).
    gc.freeze()
    code = main()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
