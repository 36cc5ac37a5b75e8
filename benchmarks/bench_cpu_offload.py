"""CPU offload benchmark: eager, fxoffload_hf, accelerate on a ~1 GB fp32 Llama, with and without a memory limit.

Run ``.venv/bin/python benchmarks/bench_cpu_offload.py`` from the repository root. Each measurement runs in
its own child process (this script with ``--child MODE``) so that its memory figures are its own; the
parent imports no torch. Under ``/sys/fs/cgroup/memory`` (cgroup v1, needs root) the three modes are run
again with a hard limit of import baseline + budget + 128 MiB (``--slack-mib``), beside a disk bound measured with plain
sequential reads. Compare figures only within one run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import disk, engine, measure, model, report, rounds, targets
from harness.cgroup import MemoryCgroup, cgroups_writable
from harness.children import (
    ChildRun,
    add_child_options,
    build_once,
    limited_row,
    run_child,
    serve_child,
    summarize,
)
from harness.cpu import wait_for_idle
from harness.protocol import emit, phase
from harness.sampling import MemoryMarks

TIMELINE_ENV, TRACE_ENV = "FXOFFLOAD_BENCH_TIMELINE", "FXOFFLOAD_BENCH_TRACE"
MODES = ("eager", "fxoffload", "accelerate")
EXTRA_MODES = ("fxoffload-deferred",)  # the default capture, eager calls within the budget: --only
MiB = 2**20
PROMPT_TOKENS = 64
WARMUP_TOKENS = 4
BUDGET_SHARE = 0.25
LIMIT_SLACK = 128 * MiB
SCRIPT = Path(__file__).resolve()


def child_run(mode: str, model_dir: Path, budget: int, new_tokens: int) -> None:
    """Load, warm up, then time one prefill forward and one greedy generate; emit one result line."""
    marks = MemoryMarks()
    # taken after torch and fxoffload_hf's core are in (process_status lives there), before the rest
    marks.mark("before_import")
    import torch
    import transformers  # noqa: F401

    if mode.startswith("fxoffload"):
        import fxoffload_hf.integrations.transformers  # noqa: F401
    model.import_model_code(model_dir)
    marks.mark("after_import")
    phase("load")
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as offload_dir:
        start = time.perf_counter()
        lm = model.load_model(mode, model_dir, budget, Path(offload_dir)).eval()
        load_s = time.perf_counter() - start
        marks.mark("after_load")
        gen = measure.prompt(lm.config.vocab_size, PROMPT_TOKENS, model.SEED)
        warmup_s = measure.warm_up(lm, gen, WARMUP_TOKENS)
        engine_before = engine.engine_report(lm)
        marks.window("measure_start")
        phase("measure")
        title = "fxoffload_hf bench: prefill + generate"
        with measure.timeline(lm, os.environ.get(TIMELINE_ENV), os.environ.get(TRACE_ENV), title):
            timed = measure.timed(lm, gen, new_tokens)
        result: dict[str, Any] = {"event": "result", "mode": mode, "load_s": load_s, "warmup_s": warmup_s}
        result.update(timed, threads=torch.get_num_threads(), memory=marks.finish("end"))
        engine_after = engine.engine_report(lm)
        if engine_before is not None and engine_after is not None:
            result["engine"] = engine.measured(engine_before, engine_after)
        emit(result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--size-gb", type=float, default=1.0, help="model size in GB (fp32), default 1.0")
    add("--vocab", type=int, default=model.VOCAB, help=f"vocabulary size, default {model.VOCAB}")
    add(
        "--budget-share",
        type=float,
        default=BUDGET_SHARE,
        help=f"cpu_memory as a share of the weights, default {BUDGET_SHARE}",
    )
    add(
        "--slack-mib",
        type=int,
        default=LIMIT_SLACK // MiB,
        help="the limit's slack over baseline + budget, MiB (default 128)",
    )
    add("--model-dir", type=Path, default=None, help="cache folder of the model (built once)")
    add("--new-tokens", type=int, default=16, help="tokens generated in the timed run")
    add("--rounds", type=int, default=5, help="interleaved rounds of the runs without a limit (median kept)")
    add("--skip-limit", action="store_true", help="skip the runs under a cgroup memory limit")
    add(
        "--only", default=",".join(MODES), help=f"comma-separated modes of {','.join((*MODES, *EXTRA_MODES))}"
    )
    add("--limit-timeout", type=float, default=300.0, help="seconds per run under the limit")
    add("--timeout", type=float, default=900.0, help="seconds per run without a limit")
    add("--wait-idle", type=float, default=300.0, help="before each run, wait up to this long for idle CPUs")
    add("--out", type=Path, default=Path("bench_results/bench_cpu_offload.json"))
    add("--timeline", default=None, help="PNG of fxoffload's copy and compute per piece (no limit)")
    add("--trace", default=None, help="the same as a Chrome trace (JSON) for Perfetto")
    add_child_options(parser, (*MODES, *EXTRA_MODES))
    args = parser.parse_args(argv)
    if args.model_dir is None:
        vocab = "" if args.vocab == model.VOCAB else f"-vocab{args.vocab}"
        args.model_dir = Path.home() / ".cache" / "fxoffload_hf" / f"bench-llama-{args.size_gb:g}g{vocab}"
    args.model_dir = args.model_dir.expanduser().resolve()
    args.modes = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.modes) - {*MODES, *EXTRA_MODES}
    if unknown:
        parser.error(
            f"--only: unknown modes {sorted(unknown)}; choose from {','.join((*MODES, *EXTRA_MODES))}"
        )
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token comes from prefill)")
    return args


def run_limited(args: argparse.Namespace, out: dict, rows: list, child_args: list[str]) -> float | None:
    """The runs under a cgroup limit of baseline + budget + slack, beside the disk's bound; the bound."""
    logs, budget = args.out.parent / "logs", out["settings"]["budget_bytes"]
    argv = ["--child", "baseline", "--model-dir", str(args.model_dir)]
    base = run_child(SCRIPT, argv, 300, logs / "baseline.log")
    if base.result is None:
        print("the baseline child failed; skipping the runs under a memory limit", file=sys.stderr)
        out["limited_skipped"] = "baseline child failed"
        return None
    baseline = base.result["memory"]["VmRSS"]
    slack = args.slack_mib * MiB
    limit, streamed = baseline + budget + slack, out["model"]["checkpoint_bytes"] - budget
    out["limit"] = {
        "baseline_vmrss_bytes": baseline,
        "baseline_memory": base.result["memory"],
        "limit_bytes": limit,
        "formula": f"import baseline VmRSS + budget + {args.slack_mib} MiB",
    }
    wait_for_idle(args.wait_idle)
    files, eager_rate = model.safetensors_files(args.model_dir), targets.rate(out["free"].get("eager"))
    bound_facts = out["disk_bound"] = disk.measure_bound(files, streamed, eager_rate)
    read_s, bound = bound_facts["read_seconds_median"], bound_facts["tok_s"]
    print(
        f"limit: baseline {baseline / MiB:.0f} MiB + budget {budget / MiB:.0f} MiB + {args.slack_mib} MiB = "
        f"{limit / MiB:.0f} MiB; disk: {streamed / 1e6:.0f} MB/token in {read_s:.3f} s "
        f"({streamed / read_s / 1e6:.0f} MB/s), bound {report.fmt(bound)} tok/s",
        flush=True,
    )
    for mode in args.modes:
        print(
            f"[{time.perf_counter() - args.wall:6.0f}s] {mode}, limit {limit / MiB:.0f} MiB ...", flush=True
        )

        def run(group: MemoryCgroup, mode: str = mode) -> ChildRun:
            disk.drop_caches()
            log = logs / f"{mode}-limited.log"
            return run_child(
                SCRIPT, ["--child", mode, *child_args], args.limit_timeout, log, group, args.wait_idle
            )

        out["limited"][mode] = limited_row(f"fxoffload-bench-{mode}", limit, run)
        rows.append((mode, f"{limit / MiB:.0f} MiB", out["limited"][mode]))
    return bound


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model.llama_config(args.size_gb, vocab=args.vocab)
    if serve_child(
        args.child,
        args.model_dir,
        config,
        lambda mode: child_run(mode, args.model_dir, args.budget, args.new_tokens),
    ):
        return 0

    args.wall = time.perf_counter()
    logs = args.out.parent / "logs"
    if not build_once(
        SCRIPT,
        args.model_dir,
        config,
        ["--size-gb", str(args.size_gb), "--vocab", str(args.vocab)],
        logs / "build.log",
    ):
        return 1
    facts = model.checkpoint_facts(args.model_dir)
    total = facts["checkpoint_bytes"]
    budget = int(total * args.budget_share)
    print(f"model: LlamaForCausalLM {json.dumps(config)}")
    print(
        f"checkpoint: {total / 1e6:.0f} MB in {facts['shards']} shards, largest tensor "
        f"{facts['largest_tensor_bytes'] / 1e6:.1f} MB; budget {args.budget_share:.0%} = {budget / MiB:.0f} MiB; "
        f"prompt {PROMPT_TOKENS} tokens, greedy, {args.new_tokens} new tokens (warm-up {WARMUP_TOKENS})",
        flush=True,
    )
    if args.timeline:
        os.environ[TIMELINE_ENV] = str(Path(args.timeline).resolve())
    if args.trace:
        os.environ[TRACE_ENV] = str(Path(args.trace).resolve())
    child_args = ["--model-dir", str(args.model_dir), "--budget", str(budget)]
    child_args += ["--new-tokens", str(args.new_tokens)]
    out: dict[str, Any] = {
        **report.header(config, facts, model.SEED),
        "settings": {
            "budget_bytes": budget,
            "budget_share": args.budget_share,
            "prompt_tokens": PROMPT_TOKENS,
            "warmup_tokens": WARMUP_TOKENS,
            "new_tokens": args.new_tokens,
            "limit_slack_bytes": args.slack_mib * MiB,
        },
        "free": {},
        "limited": {},
    }

    def free_run(mode: str, index: int) -> dict[str, Any]:
        print(
            f"[{time.perf_counter() - args.wall:6.0f}s] {mode}, no limit (round {index + 1}/{args.rounds}) ...",
            flush=True,
        )
        disk.drop_caches()
        log = logs / f"{mode}-{index}.log"
        return summarize(
            run_child(SCRIPT, ["--child", mode, *child_args], args.timeout, log, None, args.wait_idle)
        )

    rows: list[tuple[str, str, dict[str, Any]]] = []
    for mode, runs in rounds.interleave(args.modes, args.rounds, free_run).items():
        out["free"][mode] = rounds.median_run(runs)
        rows.append((mode, "none", out["free"][mode]))

    bound = None
    why_not = "--skip-limit" if args.skip_limit else cgroups_writable()
    if why_not is not None:
        print(f"skipping the runs under a memory limit: {why_not}")
        out["limited_skipped"] = why_not
    else:
        os.environ.pop(TIMELINE_ENV, None)  # pictures are of the run without a limit
        os.environ.pop(TRACE_ENV, None)
        bound = run_limited(args, out, rows, child_args)

    print()
    eager_tokens = out["free"].get("eager", {}).get("tokens")
    print("\n".join(report.table_lines(rows, eager_tokens) + report.note_lines(out, rows, bound)))
    print("\ntargets:")
    out["targets"] = targets.offload_targets(out["free"], out["limited"], bound, budget)
    out["wall_seconds"] = round(time.perf_counter() - args.wall, 1)
    report.write_json(args.out, out)
    print(f"\nwrote {args.out} ({out['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
