"""Throughput benchmark: a batch of prompts of different lengths through fxoffload_hf, one by one, accelerate, eager.

Run ``.venv/bin/python benchmarks/bench_throughput.py`` from the repository root (``make bench-throughput``).
32 seeded prompts of 8 to 64 random tokens, left-padded into one batch with its attention mask, each given
16 greedy new tokens: (a) fxoffload with the whole batch in one generate, (b) fxoffload with the prompts one
by one (a subset, ``--one-by-one``), (c) accelerate's disk offload with the whole batch, (d) eager with the
whole batch. Each run is a child process (this script with ``--child MODE``), the modes interleaved in
rounds; (a) to (c) run with a budget of 25% of the weights in a cgroup v1 with a hard limit of import
baseline + budget + the batch's KV cache + 128 MiB (fxoffload's budget, which counts the KV cache, is the
weights' share plus the cache), (d) without a limit. tokens/s counts the new tokens of every sequence over the seconds spent in
generate (prefill included, load excluded), in a second pass over the same prompts after a first one
(capture, profiling). Compare figures only within one run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import disk, engine, measure, model, report, rounds, targets
from harness.children import add_child_options, build_once, limit_baseline, mode_row, serve_child
from harness.cpu import BUSY_WARNING
from harness.protocol import emit, phase
from harness.sampling import MemoryMarks

MiB = 2**20
LIMIT_SLACK = 128 * MiB
# A quarter of the weights, as in the decode benchmark. accelerate's max_memory counts weights only, so the
# limit adds the batch's KV cache; fxoffload's budget counts everything it holds, so it is given the same:
# the weights' share plus the KV cache. Its batch still cannot hold the cache twice (a decode step holds
# the one it is passed and the one it builds) and runs as micro-batches of one block (``micro_batches``).
BUDGET_SHARE = 0.25
RATE = "tok_s"
SCRIPT = Path(__file__).resolve()


@dataclass(frozen=True)
class Mode:
    """One way of running the prompts: how the model is loaded, whole batch or one by one, under the limit."""

    loader: str  # harness.model.load_model's mode
    batched: bool
    limited: bool


MODES = {
    "fx_batch": Mode("fxoffload", batched=True, limited=True),
    "fx_one": Mode("fxoffload", batched=False, limited=True),
    "accelerate_batch": Mode("accelerate", batched=True, limited=True),
    "eager_batch": Mode("eager", batched=True, limited=False),
}


def prompts_of(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    return measure.random_prompts(vocab, args.prompts, args.shortest, args.longest, model.SEED)


def batches_of(mode: Mode, prompts: list[list[int]], one_by_one: int) -> list[dict[str, Any]]:
    """The generate calls of ``mode``: the whole left-padded batch, or the first prompts alone."""
    if mode.batched:
        return [measure.left_padded(prompts)]
    return [measure.left_padded([p]) for p in prompts[:one_by_one]]


def child_run(key: str, args: argparse.Namespace) -> None:
    """Load, a first pass (its seconds), then a timed pass over the same calls; emit one result line."""
    mode = MODES[key]
    marks = MemoryMarks()
    marks.mark("before_import")
    import torch
    import transformers  # noqa: F401

    if mode.loader == "fxoffload":
        import fxoffload_hf.integrations.transformers  # noqa: F401
    model.import_model_code(args.model_dir)
    marks.mark("after_import")
    phase("load")
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as offload_dir:
        start = time.perf_counter()
        lm = model.load_model(mode.loader, args.model_dir, args.budget, Path(offload_dir)).eval()
        load_s = time.perf_counter() - start
        marks.mark("after_load")
        prompts = prompts_of(args, lm.config.vocab_size)
        batches = batches_of(mode, prompts, args.one_by_one)
        phase("first")
        first = measure.throughput(lm, batches[:1], args.new_tokens, "first")
        # the first pass may leave memory in reference cycles (a capture's dynamo state holding the KV
        # caches it saw): measured here, then freed, so the timed pass starts from what is really held
        marks.mark("after_first")
        gc.collect()
        engine_before = engine.engine_report(lm)
        marks.window("measure_start")
        phase("measure")
        timed = measure.throughput(lm, batches, args.new_tokens, "measure")
        result: dict[str, Any] = {"event": "result", "mode": key, "load_s": load_s}
        result.update(timed, first_generate_s=first["generate_s"], load_first_s=load_s + first["generate_s"])
        result.update(threads=torch.get_num_threads(), memory=marks.finish("end"))
        engine_after = engine.engine_report(lm)
        if engine_before is not None and engine_after is not None:
            result["engine"] = engine.measured(engine_before, engine_after)
        if key == "eager_batch":  # eager's tokens for the prompts alone, as fx_one runs them (untimed)
            one = batches_of(MODES["fx_one"], prompts, args.one_by_one)
            result["tokens_one_by_one"] = measure.throughput(lm, one, args.new_tokens, "reference")["tokens"]
        emit(result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--size-gb", type=float, default=0.5, help="model size in GB (fp32), default 0.5")
    add("--model-dir", type=Path, default=None, help="cache folder of the model (built once)")
    add("--prompts", type=int, default=32, help="prompts in the batch, default 32")
    add("--shortest", type=int, default=8, help="tokens of the shortest prompt, default 8")
    add("--longest", type=int, default=64, help="tokens of the longest prompt, default 64")
    add("--new-tokens", type=int, default=16, help="greedy new tokens for every prompt, default 16")
    add("--one-by-one", type=int, default=4, help="prompts fxoffload runs one by one, default 4")
    add(
        "--budget-share",
        type=float,
        default=BUDGET_SHARE,
        help=f"budget as a share of the weights, default {BUDGET_SHARE}",
    )
    add("--rounds", type=int, default=3, help="interleaved rounds (the median run is kept), default 3")
    add("--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add("--timeout", type=float, default=600.0, help="seconds per run")
    add("--wait-idle", type=float, default=30.0, help="before each run, wait up to this long for idle CPUs")
    add("--out", type=Path, default=Path("bench_results/bench_throughput.json"))
    add_child_options(parser, MODES)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = Path.home() / ".cache" / "fxoffload_hf" / f"bench-llama-{args.size_gb:g}g"
    args.model_dir = args.model_dir.expanduser().resolve()
    args.modes = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--only: unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    if not 1 <= args.shortest <= args.longest:
        parser.error("need 1 <= --shortest <= --longest")
    if not 1 <= args.one_by_one <= args.prompts:
        parser.error("need 1 <= --one-by-one <= --prompts")
    return args


def child_argv(args: argparse.Namespace, budget: int) -> list[str]:
    """What every child is told besides its mode."""
    out = ["--model-dir", str(args.model_dir), "--budget", str(budget), "--new-tokens", str(args.new_tokens)]
    out += ["--prompts", str(args.prompts), "--shortest", str(args.shortest), "--longest", str(args.longest)]
    return out + ["--one-by-one", str(args.one_by_one)]


def memory_limit(args: argparse.Namespace, out: dict[str, Any], budget: int, kv: int) -> int | None:
    """The hard limit of the runs under a limit (import baseline + budget + KV cache + slack), or None
    (and why, in ``out``) when there is none."""
    memory, why_not = limit_baseline(
        SCRIPT, args.model_dir, args.out.parent / "logs" / "throughput-baseline.log"
    )
    if memory is None:
        print(f"no memory limit: {why_not}; every mode runs without one", flush=True)
        out["limit_skipped"] = why_not
        return None
    baseline = memory["VmRSS"]
    limit = baseline + budget + kv + LIMIT_SLACK
    out["limit"] = {
        "baseline_vmrss_bytes": baseline,
        "baseline_memory": memory,
        "kv_cache_bytes": kv,
        "limit_bytes": limit,
        "formula": "import baseline VmRSS + budget + KV cache of the batch + 128 MiB",
    }
    print(
        f"limit: baseline {baseline / MiB:.0f} MiB + budget {budget / MiB:.0f} MiB + KV cache "
        f"{kv / MiB:.0f} MiB + 128 MiB = {limit / MiB:.0f} MiB",
        flush=True,
    )
    return limit


def table(args: argparse.Namespace, out: dict[str, Any]) -> list[str]:
    """One line per mode: batch, limit, tokens/s, load + first pass, peaks, tokens against eager's."""
    runs, limit = out["runs"], out.get("limit", {}).get("limit_bytes")
    eager = runs.get("eager_batch", {})
    lines = [
        (
            "mode",
            "batch",
            "limit",
            "tok/s",
            "generate s",
            "load+first s",
            "peak private MiB",
            "cgroup peak MiB",
            "tokens = eager",
        )
    ]
    for key, row in runs.items():
        mode = MODES[key]
        batch = str(args.prompts) if mode.batched else f"1 ({args.one_by_one} of {args.prompts} prompts)"
        expected = eager.get("tokens") if mode.batched else eager.get("tokens_one_by_one")
        ok = row.get("status") == "ok"
        mem, group = row.get("memory") or {}, row.get("cgroup") or {}
        lines.append(
            (
                mode.loader,
                batch,
                f"{limit / MiB:.0f} MiB" if mode.limited and limit else "none",
                report.fmt(row.get(RATE)) if ok else row.get("status", "-"),
                report.fmt(row.get("generate_s")),
                report.fmt(row.get("load_first_s"), ".1f"),
                report.fmt(mem.get("peak_anon") and mem["peak_anon"] / MiB, ".0f"),
                report.fmt(group.get("max_usage") and group["max_usage"] / MiB, ".0f"),
                "(itself)" if key == "eager_batch" else report.sequences_equal(row.get("tokens"), expected),
            )
        )
    return report.aligned(lines)


def notes(out: dict[str, Any]) -> list[str]:
    """Rates by round, failures, busy CPUs, fxoffload's engine figures, what the figures mean."""
    lines = []
    for key, row in out["runs"].items():
        by_round = ", ".join(report.fmt(r) for r in row.get(RATE + "_rounds", []))
        if by_round:
            lines.append(f"{key} tok/s by round: {by_round} (the median run is shown)")
        if row.get("status") != "ok":
            last = (row.get("log_tail") or "").strip().splitlines()[-1:]
            lines.append(f"note: {key}: {row.get('status')}" + (f": {last[0]}" if last else ""))
        if row.get("foreign_cpu_share", 0) > BUSY_WARNING:
            lines.append(f"WARNING: {key}: other processes used {row['foreign_cpu_share']:.0%} of the CPUs")
        if row.get("engine"):
            lines.append(
                f"{key} engine: {row['engine']['store']}; measured: {row['engine']['measure_delta']}"
            )
    rises = [
        f"{key} {(row['memory']['peak_anon'] - row['memory']['after_import']['RssAnon']) / MiB:.0f} MiB"
        for key, row in out["runs"].items()
        if row.get("memory")
    ]
    if rises:
        lines.append("peak private rise over import (the timed pass): " + ", ".join(rises))
    garbage = [
        f"{key} {(row['memory']['after_first']['RssAnon'] - row['memory']['measure_start']['RssAnon']) / MiB:.0f} MiB"
        for key, row in out["runs"].items()
        if row.get("memory", {}).get("after_first")
    ]
    if garbage:
        lines.append("private memory gc.collect() freed after the first pass: " + ", ".join(garbage))
    lines.append(
        "(tok/s = new tokens of all sequences / seconds in generate, prefill included, in the pass after the "
        "first (and a gc.collect()); load+first s = load + the first generate (capture, profiling); peak "
        "private = max RssAnon over the timed pass, import baseline included; cgroup peak = the group's max usage over the whole "
        "run, page cache included; tokens = eager: per sequence, against eager's run of the same batch, the "
        "prompts alone for batch 1)"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model.llama_config(args.size_gb)
    if serve_child(args.child, args.model_dir, config, lambda mode: child_run(mode, args)):
        return 0

    wall, logs = time.perf_counter(), args.out.parent / "logs"
    if not build_once(
        SCRIPT, args.model_dir, config, ["--size-gb", str(args.size_gb)], logs / "throughput-build.log"
    ):
        return 1
    facts = model.checkpoint_facts(args.model_dir)
    budget = int(facts["checkpoint_bytes"] * args.budget_share)
    kv = model.kv_cache_bytes(config, args.prompts, args.longest + args.new_tokens)
    print(f"model: LlamaForCausalLM {json.dumps(config)}")
    print(
        f"checkpoint: {facts['checkpoint_bytes'] / 1e6:.0f} MB; budget {args.budget_share:.0%} = "
        f"{budget / MiB:.0f} MiB; {args.prompts} prompts of {args.shortest} to {args.longest} tokens "
        f"(left-padded), {args.new_tokens} greedy new tokens each; one by one: the first {args.one_by_one}",
        flush=True,
    )
    out: dict[str, Any] = {
        **report.header(config, facts, model.SEED),
        "settings": {
            "budget_bytes": budget,
            "budget_share": args.budget_share,
            "prompts": args.prompts,
            "prompt_lengths": [len(p) for p in prompts_of(args, config["vocab_size"])],
            "new_tokens": args.new_tokens,
            "one_by_one": args.one_by_one,
            "limit_slack_bytes": LIMIT_SLACK,
        },
        "lightning": "make bench-blocks (benchmarks/bench_predict_blocks.py)",
        "runs": {},
    }
    limit = memory_limit(args, out, budget, kv) if any(MODES[m].limited for m in args.modes) else None

    def run(key: str, index: int) -> dict[str, Any]:
        mode, bound = MODES[key], limit if MODES[key].limited else None
        where = f"limit {bound / MiB:.0f} MiB" if bound else "no limit"
        print(f"[{time.perf_counter() - wall:6.0f}s] {key}, {where} (round {index + 1}/{args.rounds}) ...")
        sys.stdout.flush()
        disk.drop_caches()
        # fxoffload's budget counts the KV cache, accelerate's does not: both get the same memory
        own = budget + kv if mode.loader == "fxoffload" else budget
        log, argv = logs / f"throughput-{key}-{index}.log", ["--child", key, *child_argv(args, own)]
        return mode_row(
            SCRIPT, argv, log, args.timeout, args.wait_idle, bound, f"fxoffload-bench-{mode.loader}"
        )

    for key, runs in rounds.interleave(args.modes, args.rounds, run).items():
        out["runs"][key] = rounds.median_run(runs, key=RATE)

    print()
    print("\n".join(table(args, out) + notes(out)))
    print(
        "\nLightning predict loops in blocks of batches: make bench-blocks (benchmarks/bench_predict_blocks.py)"
    )
    print("\ntargets:")
    runs = out["runs"]
    fx, one, acc = runs.get("fx_batch"), runs.get("fx_one"), runs.get("accelerate_batch")
    out["targets"] = [
        targets.at_least(
            f"tok/s fxoffload batch {args.prompts} / batch 1", fx, one, targets.rate(one, RATE), 16, RATE
        ),
        targets.at_least(
            f"tok/s fxoffload / accelerate, batch {args.prompts}", fx, acc, targets.rate(acc, RATE), 2, RATE
        ),
    ]
    out["wall_seconds"] = round(time.perf_counter() - wall, 1)
    report.write_json(args.out, out)
    print(f"\nwrote {args.out} ({out['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
