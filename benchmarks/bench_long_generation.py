"""Long-generation benchmark: a KV cache that outgrows the budget, under a hard memory limit.

Run ``.venv/bin/python benchmarks/bench_long_generation.py`` from the repository root (``make bench-long``).
A Llama of about 0.13 GB whose KV cache is large against its weights (hidden 512 in 8 full heads, 15
layers: 60 KiB a token) generates ``--new-tokens`` greedy tokens (1,000 by default: a 60 MiB cache)
after a 32-token prompt, one process per mode: fxoffload (the default capture) and accelerate's disk
offload with ``cpu_memory`` / ``max_memory`` = ``--budget-share`` of the weights, in a cgroup v1 with a hard
limit of import baseline + budget + 64 MiB; eager without a limit, for its tokens. fxoffload's budget
counts the KV cache: where it cannot hold it, the cache goes to files (``kv_disk``), about two layers of
it in memory at a time; accelerate's budget counts weights only, and its cache grows in RAM. tokens/s
counts the new tokens over the seconds of the one generate (prefill, capture and a restart included: a
long job is run once). Compare figures only within one run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from harness import disk, engine, measure, model, report
from harness.children import add_child_options, build_once, limit_baseline, mode_row, serve_child
from harness.protocol import StepClock, emit, phase
from harness.sampling import MemoryMarks

MiB = 2**20
LIMIT_SLACK = 64 * MiB
BUDGET_SHARE = 0.25
PROMPT_TOKENS = 32
# the model: a KV cache of 60 KiB a token against 8 MB of weights a layer, so that a cache of a thousand
# tokens outgrows a quarter of the weights
CONFIG = {"vocab": 4000, "hidden": 512, "intermediate": 512, "heads": 8}
SIZE_GB = 0.13
# mode -> how ``harness.model.load_model`` loads it (fxoffload: its default capture), and whether it runs
# under the limit
MODES = {
    "fxoffload": ("fxoffload-deferred", True),
    "accelerate": ("accelerate", True),
    "eager": ("eager", False),
}
SCRIPT = Path(__file__).resolve()


def child_run(mode: str, args: argparse.Namespace) -> None:
    """Load, then one timed greedy generate of ``--new-tokens``; emit one result line."""
    marks = MemoryMarks()
    marks.mark("before_import")
    import torch
    import transformers  # noqa: F401

    if mode == "fxoffload":
        import fxoffload_hf.integrations.transformers  # noqa: F401
    model.import_model_code(args.model_dir)
    marks.mark("after_import")
    phase("load")
    with tempfile.TemporaryDirectory(prefix="bench-long-", dir=args.model_dir.parent) as offload_dir:
        start = time.perf_counter()
        lm = model.load_model(MODES[mode][0], args.model_dir, args.budget, Path(offload_dir)).eval()
        load_s = time.perf_counter() - start
        marks.mark("after_load")
        gen = measure.prompt(lm.config.vocab_size, PROMPT_TOKENS, model.SEED)
        marks.window("measure_start")
        phase("measure")
        clock = StepClock("measure")
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            start = time.perf_counter()
            out = measure.generate(lm, gen, args.new_tokens, clock)
            generate_s = time.perf_counter() - start
        result: dict[str, Any] = {"event": "result", "mode": mode, "load_s": load_s}
        result.update(
            generate_s=generate_s,
            tok_s=args.new_tokens / generate_s,
            tokens=out[0, PROMPT_TOKENS:].tolist(),
            kv_cache_on_disk=any(type(w.message).__name__ == "KVCacheOnDiskWarning" for w in caught),
            memory=marks.finish("end"),
        )
        report_now = engine.engine_report(lm)
        if report_now is not None:
            result["engine"] = report_now
        emit(result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--new-tokens", type=int, default=1000, help="greedy new tokens, default 1000")
    add(
        "--budget-share",
        type=float,
        default=BUDGET_SHARE,
        help=f"budget as a share of the weights, default {BUDGET_SHARE}",
    )
    add("--model-dir", type=Path, default=None, help="cache folder of the model (built once)")
    add("--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add("--timeout", type=float, default=1200.0, help="seconds per run")
    add("--wait-idle", type=float, default=60.0, help="before each run, wait up to this long for idle CPUs")
    add("--out", type=Path, default=Path("bench_results/bench_long_generation.json"))
    add_child_options(parser, MODES)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = Path.home() / ".cache" / "fxoffload_hf" / "bench-long-kv"
    args.model_dir = args.model_dir.expanduser().resolve()
    args.modes = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--only: unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    return args


def limit_of(args: argparse.Namespace, out: dict[str, Any], budget: int) -> int | None:
    """Import baseline + budget + 64 MiB, or None (why, in ``out``) where no cgroup can be made."""
    base, why_not = limit_baseline(SCRIPT, args.model_dir, args.out.parent / "logs" / "long-baseline.log")
    if base is None:
        print(f"no memory limit: {why_not}; every mode runs without one", flush=True)
        out["limit_skipped"] = why_not
        return None
    limit = base["VmRSS"] + budget + LIMIT_SLACK
    out["limit"] = {"bytes": limit, "formula": "import baseline VmRSS + budget + 64 MiB"}
    return limit


def table(out: dict[str, Any], limit: int | None) -> list[str]:
    """One line per mode: limit, tok/s, where the cache went, peaks, tokens against eager's."""
    runs = out["runs"]
    expected = runs.get("eager", {}).get("tokens")
    lines = [("mode", "limit", "tok/s", "KV cache", "peak private MiB", "cgroup peak MiB", "tokens = eager")]
    for mode, row in runs.items():
        ok = row.get("status") == "ok"
        mem, group = row.get("memory") or {}, row.get("cgroup") or {}
        where = ("on disk" if row.get("kv_cache_on_disk") else "in RAM") if ok else "-"
        same = "(itself)" if mode == "eager" else _same(row.get("tokens"), expected)
        lines.append(
            (
                mode,
                f"{limit / MiB:.0f} MiB" if MODES[mode][1] and limit else "none",
                report.fmt(row.get("tok_s")) if ok else row.get("status", "-"),
                where,
                report.fmt(mem.get("peak_anon") and mem["peak_anon"] / MiB, ".0f"),
                report.fmt(group.get("max_usage") and group["max_usage"] / MiB, ".0f"),
                same,
            )
        )
    return report.aligned(lines)


def rises(out: dict[str, Any], budget: int) -> list[str]:
    """Each run's rise of private memory over the loaded model during the generate, against the budget."""
    parts = []
    for mode, row in out["runs"].items():
        mem = row.get("memory")
        if mem and mem.get("after_load"):
            rise = mem["peak_anon"] - mem["after_load"]["RssAnon"]
            parts.append(f"{mode} {rise / MiB:.0f} MiB ({rise / budget:.2f} of the budget)")
    return ["private memory rise over the loaded model: " + ", ".join(parts)] if parts else []


def _same(tokens: list[int] | None, expected: list[int] | None) -> str:
    """Whether a run's new tokens are eager's: yes, NO, or - where either is missing."""
    if tokens is None or expected is None:
        return "-"
    return "yes" if tokens == expected else "NO"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model.llama_config(SIZE_GB, **CONFIG)
    if serve_child(args.child, args.model_dir, config, lambda mode: child_run(mode, args)):
        return 0

    wall, logs = time.perf_counter(), args.out.parent / "logs"
    if not build_once(SCRIPT, args.model_dir, config, [], logs / "long-build.log"):
        return 1
    facts = model.checkpoint_facts(args.model_dir)
    budget = int(facts["checkpoint_bytes"] * args.budget_share)
    kv = model.kv_cache_bytes(config, 1, PROMPT_TOKENS + args.new_tokens)
    print(f"model: LlamaForCausalLM {json.dumps(config)}")
    print(
        f"checkpoint: {facts['checkpoint_bytes'] / 1e6:.0f} MB; budget {args.budget_share:.0%} = "
        f"{budget / MiB:.0f} MiB; a {PROMPT_TOKENS}-token prompt and {args.new_tokens} greedy new tokens: "
        f"a KV cache of {kv / MiB:.0f} MiB at the last token",
        flush=True,
    )
    out: dict[str, Any] = {
        **report.header(config, facts, model.SEED),
        "settings": {"budget_bytes": budget, "new_tokens": args.new_tokens, "kv_cache_bytes": kv},
        "runs": {},
    }
    limit = limit_of(args, out, budget) if any(MODES[m][1] for m in args.modes) else None
    for mode in args.modes:
        bound = limit if MODES[mode][1] else None
        where = f"limit {bound / MiB:.0f} MiB" if bound else "no limit"
        print(f"[{time.perf_counter() - wall:6.0f}s] {mode}, {where} ...", flush=True)
        disk.drop_caches()
        argv = ["--child", mode, "--model-dir", str(args.model_dir), "--budget", str(budget)]
        argv += ["--new-tokens", str(args.new_tokens)]
        out["runs"][mode] = mode_row(
            SCRIPT,
            argv,
            logs / f"long-{mode}.log",
            args.timeout,
            args.wait_idle,
            bound,
            f"fxoffload-long-{mode}",
        )
    print()
    print("\n".join(table(out, limit) + rises(out, budget)))
    print(
        "(tok/s = new tokens / seconds of the one generate, prefill, capture and any restart included; peak "
        "private = max RssAnon over the generate, import baseline included; cgroup peak = the group's max "
        "usage, page cache included)"
    )
    report.write_json(args.out, out)
    print(f"\nwrote {args.out} ({time.perf_counter() - wall:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
