"""Cold start: load + the first greedy generate in a fresh process, as a person waits for it.

Run ``.venv/bin/python benchmarks/bench_cold_start.py`` from the repository root (``make bench-cold``).
The model is a random Llama of about 0.77 GB with a large vocabulary against its width (vocab 32,000,
hidden 1,024, fp32), built once. Each mode runs in its own child, modes interleaved round by round:
eager (all in RAM), accelerate's disk offload and fxoffload_hf with ``capture="first-call"`` and
``capture="deferred"`` (the default), each in a first process (compile cache off) and, ``+cache``, in a
second one (the compile cache written by an untimed process before the rounds), the offloaded ones at
``cpu_memory`` = a quarter of the weights. Each child
times the load, the first ``generate`` (64-token prompt, 16 new tokens) and a second one, and checks its
tokens against eager's. Figures are medians over the rounds; compare them only within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import disk, model
from harness.children import add_child_options, run_child
from harness.protocol import emit

SCRIPT = Path(__file__).resolve()
MODES = ("eager", "accelerate", "fx-first-call", "fx-first-call+cache", "fx-deferred", "fx-deferred+cache")
CACHED = "+cache"
PROMPT_TOKENS = 64
BUDGET_SHARE = 0.25


def child_run(mode: str, model_dir: Path, budget: int, new_tokens: int, cache_dir: Path) -> None:
    """Load ``model_dir`` in ``mode``, generate twice; emit the seconds and the tokens."""
    import torch

    torch.set_num_threads(2)
    config = json.loads((model_dir / "config.json").read_text())
    ids = torch.randint(
        0, config["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as offload_dir:
        start = time.perf_counter()
        if mode.startswith("fx-"):
            import fxoffload_hf

            capture = mode.removeprefix("fx-").removesuffix(CACHED)
            cache = cache_dir / capture if mode.endswith(CACHED) else False
            lm = fxoffload_hf.from_pretrained(
                model_dir, cpu_memory=budget, device="cpu", capture=capture, compile_cache=cache
            )
        else:
            lm = model.load_model(mode, model_dir, budget, Path(offload_dir))
        loaded = time.perf_counter()
        seconds = []
        with torch.no_grad():
            for _ in range(2):
                began = time.perf_counter()
                tokens = lm.generate(
                    ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
                )
                seconds.append(time.perf_counter() - began)
        emit(
            {
                "event": "result",
                "mode": mode,
                "load_s": loaded - start,
                "first_s": seconds[0],
                "second_s": seconds[1],
                "tokens": tokens[0, PROMPT_TOKENS:].tolist(),
            }
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--rounds", type=int, default=3, help="rounds of all modes, interleaved (default 3)")
    add("--new-tokens", type=int, default=16, help="tokens each generate adds (default 16)")
    add("--size-gb", type=float, default=0.77, help="model size in GB (default 0.77)")
    add("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    add("--model-dir", type=Path, default=None, help="cache folder of the model (built once)")
    add("--out", type=Path, default=Path("bench_results/bench_cold_start.json"), help="where the JSON goes")
    add("--timeout", type=float, default=600, help="seconds a child may take (default 600)")
    add("--cache-dir", type=Path, default=None, help="the +cache modes' compile cache (default: a new one)")
    add(
        "--cold-cache",
        action="store_true",
        help="drop the page cache before each child (root): weights come from disk",
    )
    add_child_options(parser)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = Path.home() / ".cache" / "fxoffload_hf" / f"bench-llama-vocab32k-{args.size_gb:g}g"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model.llama_config(args.size_gb, vocab=32000, hidden=1024, intermediate=2816, heads=16)
    if args.child == "build":
        emit({"event": "built", **model.build(args.model_dir, config)})
        return 0
    if args.child is not None:
        child_run(args.child, args.model_dir, args.budget, args.new_tokens, args.cache_dir)
        return 0
    logs = args.out.parent / "logs"
    common = ["--model-dir", str(args.model_dir), "--size-gb", str(args.size_gb)]
    if not model.model_is_cached(args.model_dir, config):
        print(f"building the model in {args.model_dir} ...", flush=True)
        built = run_child(SCRIPT, ["--child", "build", *common], 1800, logs / "cold-build.log")
        if built.result is None:
            print(built.log_tail(), file=sys.stderr)
            return 1
    weights = model.checkpoint_facts(args.model_dir)["checkpoint_bytes"]
    budget = int(weights * BUDGET_SHARE)
    modes = [m for m in args.modes.split(",") if m]
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    cache_dir = args.cache_dir or Path(tempfile.mkdtemp(prefix="bench-cold-cache-"))
    common += ["--budget", str(budget), "--new-tokens", str(args.new_tokens), "--cache-dir", str(cache_dir)]
    for mode in (m for m in modes if m.endswith(CACHED)):  # the first process, which fills the cache
        primed = run_child(SCRIPT, ["--child", mode, *common], args.timeout, logs / f"cold-{mode}-prime.log")
        if primed.result is None:
            print(f"{mode}: no result\n{primed.log_tail()}", file=sys.stderr)
            return 1
    for round_ in range(args.rounds):
        for mode in modes:
            if args.cold_cache and not disk.drop_caches():
                print("--cold-cache needs root (/proc/sys/vm/drop_caches)", file=sys.stderr)
                return 1
            argv_ = ["--child", mode, *common]
            run = run_child(SCRIPT, argv_, args.timeout, logs / f"cold-{mode}-{round_}.log")
            if run.result is None:
                print(f"{mode}: no result\n{run.log_tail()}", file=sys.stderr)
                return 1
            rows[mode].append(run.result)
            print(f"round {round_ + 1} {mode}: load {run.result['load_s']:.2f} s, first generate "
                  f"{run.result['first_s']:.2f} s, second {run.result['second_s']:.2f} s", flush=True)  # fmt: skip
    print(table(rows, weights, budget, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"weights": weights, "budget": budget, "rows": rows}, indent=1))
    return 0


def table(rows: dict[str, list[dict[str, Any]]], weights: int, budget: int, args: argparse.Namespace) -> str:
    """Medians per mode, and load + first generate as a multiple of accelerate's."""
    eager_tokens = rows["eager"][0]["tokens"] if rows.get("eager") else None

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[mode])

    reference = (
        median("accelerate", "load_s") + median("accelerate", "first_s") if "accelerate" in rows else None
    )
    lines = [
        f"cold start, {weights / 1e9:.2f} GB Llama (vocab 32,000, hidden 1,024), budget {budget / 2**20:.0f} MiB, "
        f"prompt {PROMPT_TOKENS} tokens, {args.new_tokens} new, median of {args.rounds} rounds"
        + (", page cache dropped before each process" if args.cold_cache else ""),
        "",
        "| mode | load s | first generate s | load + first s | vs accelerate | second generate s | tokens = eager |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode in rows:
        cold = median(mode, "load_s") + median(mode, "first_s")
        ratio = f"{cold / reference:.2f}x" if reference else "-"
        same = "-" if eager_tokens is None else str(all(r["tokens"] == eager_tokens for r in rows[mode]))
        lines.append(
            f"| {mode} | {median(mode, 'load_s'):.2f} | {median(mode, 'first_s'):.2f} | {cold:.2f} | {ratio} "
            f"| {median(mode, 'second_s'):.2f} | {same} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
