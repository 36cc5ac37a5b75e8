"""Lightning predict in blocks: each streamed weight serves K batches (``FxOffloadCallback(batches_per_block=K)``).

Run ``.venv/bin/python benchmarks/bench_predict_blocks.py`` from the repository root (``make bench-blocks``).
A random Llama (0.77 GB, vocab 32,000, hidden 1,024, fp32) offloaded by ``fxoffload_hf.from_pretrained`` at
a quarter of its weights, wrapped in a LightningModule whose ``predict_step`` returns the next-token logits
of each prompt; ``Trainer.predict`` over 64 batches of one 16-token prompt, with blocks of 1 and 8 batches.
Each run is a child process in a cgroup v1 with a hard limit of import baseline (Lightning included) +
budget + 128 MiB, so the weights beyond the budget are read from disk at every graph run; eager runs the
same batches without a limit, for the predictions. The modes are interleaved in rounds; a first predict
over one block captures the graph, the second (timed) covers all batches. Compare figures only within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import disk, model, report, rounds, targets
from harness.cgroup import cgroups_writable
from harness.children import add_child_options, build_once, mode_row, run_child, serve_child
from harness.protocol import emit, phase
from harness.sampling import MemoryMarks, import_baseline

MiB = 2**20
LIMIT_SLACK = 128 * MiB
RATE = "batches_s"
SCRIPT = Path(__file__).resolve()


def modes_of(blocks: list[int]) -> dict[str, int | None]:
    """Mode name -> batches per block (None: eager, every weight in RAM)."""
    return {**{f"fx_blocks_{k}": k for k in blocks}, "eager": None}


def batches_of(args: argparse.Namespace, vocab: int) -> list[Any]:
    import torch

    generator = torch.Generator().manual_seed(model.SEED)
    shape = (args.batch_size, args.tokens)
    return [[torch.randint(0, vocab, shape, generator=generator)] for _ in range(args.batches)]


def child_run(key: str, block: int | None, args: argparse.Namespace) -> None:
    """Load, predict over one block (capture), then over every batch (timed); emit one result line."""
    marks = MemoryMarks()
    marks.mark("before_import")
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from fxoffload_hf.callbacks import FxOffloadCallback

    model.import_model_code(args.model_dir)
    marks.mark("after_import")

    class NextToken(pl.LightningModule):
        def __init__(self, lm: Any) -> None:
            super().__init__()
            self.model = lm

        def predict_step(self, batch: list[Any], batch_idx: int) -> Any:
            return self.model(input_ids=batch[0]).logits[:, -1]

    def predict(lm: Any, batches: list[Any]) -> list[Any]:
        # the model was offloaded with its capture mode by ``load_model``: the callback takes none
        callbacks = [] if block is None else [FxOffloadCallback(target="model", batches_per_block=block)]
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            logger=False,
            callbacks=callbacks,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
        )
        out = trainer.predict(NextToken(lm), DataLoader(batches, batch_size=None))
        assert out is not None
        return out

    phase("load")
    with tempfile.TemporaryDirectory(prefix="bench-blocks-") as offload_dir:
        start = time.perf_counter()
        loader = "eager" if block is None else "fxoffload"
        lm = model.load_model(loader, args.model_dir, args.budget, Path(offload_dir)).eval()
        load_s = time.perf_counter() - start
        batches = batches_of(args, lm.config.vocab_size)
        phase("first")
        start = time.perf_counter()
        predict(lm, batches[: block or 1])
        first_s = time.perf_counter() - start
        marks.window("measure_start")
        phase("measure")
        start = time.perf_counter()
        logits = predict(lm, batches)
        seconds = time.perf_counter() - start
        result: dict[str, Any] = {"event": "result", "mode": key, "load_s": load_s, "first_s": first_s}
        result.update(seconds=seconds, batches_s=len(batches) / seconds)
        result["tokens"] = [row.argmax(-1).tolist() for row in logits]
        result["logits_digest"] = float(sum(row.double().abs().sum() for row in logits))
        if block is not None:
            import fxoffload_hf

            stats = fxoffload_hf.engine_of(lm).stats
            result["engine"] = {"calls": stats.calls, "graph_runs": stats.runs, "bytes": stats.bytes_streamed}
        result.update(threads=torch.get_num_threads(), memory=marks.finish("end"))
        emit(result)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--size-gb", type=float, default=0.77, help="model size in GB (fp32), default 0.77")
    add("--vocab", type=int, default=32000, help="vocabulary, default 32000")
    add("--model-dir", type=Path, default=None, help="cache folder of the model (built once)")
    add("--batches", type=int, default=64, help="predict batches, default 64")
    add("--batch-size", type=int, default=1, help="prompts per batch, default 1")
    add("--tokens", type=int, default=16, help="tokens per prompt, default 16")
    add("--blocks", default="1,8", help="batches per block to compare, default 1,8")
    add("--budget-share", type=float, default=0.25, help="budget as a share of the weights, default 0.25")
    add("--rounds", type=int, default=2, help="interleaved rounds (the median run is kept), default 2")
    add("--timeout", type=float, default=900.0, help="seconds per run")
    add("--wait-idle", type=float, default=30.0, help="before each run, wait up to this long for idle CPUs")
    add("--out", type=Path, default=Path("bench_results/bench_predict_blocks.json"))
    add_child_options(parser)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        name = f"bench-llama-{args.size_gb:g}g-vocab{args.vocab}"
        args.model_dir = Path.home() / ".cache" / "fxoffload_hf" / name
    args.model_dir = args.model_dir.expanduser().resolve()
    args.block_sizes = sorted({int(k) for k in args.blocks.split(",") if k.strip()})
    if not args.block_sizes or min(args.block_sizes) < 1:
        parser.error("--blocks: whole numbers >= 1, comma-separated")
    return args


def child_argv(args: argparse.Namespace, budget: int) -> list[str]:
    out = ["--model-dir", str(args.model_dir), "--budget", str(budget), "--batches", str(args.batches)]
    return out + ["--batch-size", str(args.batch_size), "--tokens", str(args.tokens), "--blocks", args.blocks]


def baseline_memory(model_dir: Path) -> dict[str, int]:
    """The children's import baseline, Lightning included."""
    import lightning.pytorch  # noqa: F401

    return import_baseline(model_dir)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model.llama_config(args.size_gb, vocab=args.vocab)
    modes = modes_of(args.block_sizes)
    if serve_child(
        args.child, args.model_dir, config, lambda mode: child_run(mode, modes[mode], args), baseline_memory
    ):
        return 0

    wall, logs = time.perf_counter(), args.out.parent / "logs"
    if not build_once(
        SCRIPT,
        args.model_dir,
        config,
        ["--size-gb", str(args.size_gb), "--vocab", str(args.vocab)],
        logs / "blocks-build.log",
    ):
        return 1
    facts = model.checkpoint_facts(args.model_dir)
    budget = int(facts["checkpoint_bytes"] * args.budget_share)
    print(f"model: LlamaForCausalLM {json.dumps(config)}")
    print(
        f"checkpoint: {facts['checkpoint_bytes'] / 1e6:.0f} MB; budget {args.budget_share:.0%} = "
        f"{budget / MiB:.0f} MiB; {args.batches} batches of {args.batch_size} x {args.tokens} tokens; "
        f"blocks of {args.blocks} batches",
        flush=True,
    )
    out: dict[str, Any] = {
        **report.header(config, facts, model.SEED),
        "settings": {"budget_bytes": budget, "budget_share": args.budget_share, "batches": args.batches},
        "runs": {},
    }
    limit = None
    why_not = cgroups_writable()
    if why_not is None:
        argv = ["--child", "baseline", "--model-dir", str(args.model_dir)]
        base = run_child(SCRIPT, argv, 300, logs / "blocks-baseline.log")
        if base.result is None:
            why_not = "the baseline child failed"
        else:
            limit = base.result["memory"]["VmRSS"] + budget + LIMIT_SLACK
            print(f"limit: import baseline + budget + 128 MiB = {limit / MiB:.0f} MiB", flush=True)
            out["limit_bytes"] = limit
    if why_not is not None:
        print(f"no memory limit: {why_not}; the weights may stay in the page cache", flush=True)
        out["limit_skipped"] = why_not

    def run(key: str, index: int) -> dict[str, Any]:
        bound = limit if modes[key] is not None else None
        where = f"limit {bound / MiB:.0f} MiB" if bound else "no limit"
        print(f"[{time.perf_counter() - wall:6.0f}s] {key}, {where} (round {index + 1}/{args.rounds}) ...")
        sys.stdout.flush()
        disk.drop_caches()
        log, argv = logs / f"blocks-{key}-{index}.log", ["--child", key, *child_argv(args, budget)]
        return mode_row(SCRIPT, argv, log, args.timeout, args.wait_idle, bound, f"fxoffload-bench-{key}")

    for key, runs in rounds.interleave(list(modes), args.rounds, run).items():
        out["runs"][key] = rounds.median_run(runs, key=RATE)

    print()
    print("\n".join(table(out)))
    print("\ntargets:")
    runs = out["runs"]
    one, most = runs.get(f"fx_blocks_{args.block_sizes[0]}"), runs.get(f"fx_blocks_{args.block_sizes[-1]}")
    out["targets"] = [
        targets.at_least(
            f"batches/s, blocks of {args.block_sizes[-1]} / blocks of {args.block_sizes[0]}",
            most,
            one,
            targets.rate(one, RATE),
            5,
            RATE,
        )
    ]
    out["wall_seconds"] = round(time.perf_counter() - wall, 1)
    report.write_json(args.out, out)
    print(f"\nwrote {args.out} ({out['wall_seconds']:.0f} s)")
    return 0


def table(out: dict[str, Any]) -> list[str]:
    runs = out["runs"]
    eager = runs.get("eager", {}).get("tokens")
    lines = [
        (
            "mode",
            "batches/s",
            "predict s",
            "load s",
            "first s",
            "graph runs",
            "GB read",
            "cgroup peak MiB",
            "= eager",
        )
    ]
    for key, row in runs.items():
        ok = row.get("status") == "ok"
        engine, group = row.get("engine") or {}, row.get("cgroup") or {}
        lines.append(
            (
                key,
                report.fmt(row.get(RATE)) if ok else row.get("status", "-"),
                report.fmt(row.get("seconds"), ".1f"),
                report.fmt(row.get("load_s"), ".1f"),
                report.fmt(row.get("first_s"), ".1f"),
                str(engine.get("graph_runs", "-")),
                report.fmt(engine.get("bytes") and engine["bytes"] / 1e9, ".1f"),
                report.fmt(group.get("max_usage") and group["max_usage"] / MiB, ".0f"),
                "(itself)" if key == "eager" else ("yes" if row.get("tokens") == eager and eager else "NO"),
            )
        )
    rates = [
        f"{key}: {', '.join(report.fmt(r) for r in row.get(RATE + '_rounds', []))}"
        for key, row in runs.items()
    ]
    return [
        *report.aligned(lines),
        "batches/s by round: " + "; ".join(rates),
        "(graph runs and GB read: the engine's counters over both predicts, the capture's included; = eager: "
        "each batch's next tokens equal eager's)",
    ]


if __name__ == "__main__":
    sys.exit(main())
