"""Coverage sweep: every model type of transformers' auto mappings, tiny, eager beside fxoffload_hf.

Run ``.venv/bin/python benchmarks/coverage.py`` from the repository root, e.g.::

    .venv/bin/python benchmarks/coverage.py --types llama,gpt2,t5 --mapping all --table
    .venv/bin/python benchmarks/coverage.py --mapping causal --resume

Each (type, mapping) runs in its own child (``coverage_child.py``) with a time limit; a child killed on
the limit is a ``hang``. A result is one of ``exact`` (bit for bit, same greedy tokens), ``close`` /
``mismatch`` (with the largest difference), ``refused`` (fxoffload_hf raised a ValueError or
NotImplementedError on purpose), ``error`` (anything else), ``hang``, or ``skipped`` (the tiny model does
not build or run eagerly). Results go to ``--out`` as JSON lines as they come; the markdown summary
(counts, failures grouped by cause, every row) is written beside it. The parent imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness.children import ChildRun, run_child
from harness.shrink import BATCH_VARIABLE, DTYPE_VARIABLE, SHAPE_VARIABLE, TINY
from harness.user_calls import CALLS_VARIABLE

HERE = Path(__file__).resolve().parent
CHILD = HERE / "coverage_child.py"
MAPPINGS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "base": "MODEL_MAPPING_NAMES",
}
STATUSES = ("exact", "close", "mismatch", "refused", "error", "hang", "skipped")


def mapping_types(mapping: str) -> list[str]:
    """The model types of one auto mapping (read in a child interpreter: the parent stays torch-free)."""
    code = (
        "import json, transformers.models.auto.modeling_auto as m; "
        f"print(json.dumps(sorted(m.{MAPPINGS[mapping]})))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def plan(mappings: list[str], only: list[str] | None) -> list[tuple[str, str]]:
    """(type, mapping) pairs to check, in mapping order; ``only`` restricts the types."""
    pairs = []
    for mapping in mappings:
        types = mapping_types(mapping)
        if only is not None:
            unknown = [t for t in only if t not in types]
            if unknown and len(mappings) == 1:
                print(f"not in the {mapping} mapping: {', '.join(unknown)}", file=sys.stderr)
            types = [t for t in only if t in types]
        pairs += [(t, mapping) for t in types]
    return pairs


def check(
    type_name: str, mapping: str, limit_s: float, logs: Path, share: float | None, keep_log: bool = False
) -> dict[str, Any]:
    """Run one child and turn what came back into a row; its log is kept where it did not pass, or where
    ``keep_log`` (to read what the library reported on the way: refusals, captures, eager calls)."""
    work = Path(tempfile.mkdtemp(prefix=f"coverage-{type_name}-"))
    log = logs / f"{mapping}-{type_name}.log"
    shared = [] if share is None else [str(share)]
    try:
        run = run_child(CHILD, [type_name, mapping, str(work / "ckpt"), *shared], limit_s, log)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    row = row_of(type_name, mapping, run)
    if row["status"] in ("exact", "skipped") and not keep_log:
        log.unlink(missing_ok=True)
    return row


def row_of(type_name: str, mapping: str, run: ChildRun) -> dict[str, Any]:
    found = [e for e in run.events if e.get("event") == "result"]
    phases = [e["phase"] for e in run.events if e.get("event") == "phase"]
    where = phases[-1] if phases else "start"
    if found and not run.timed_out:
        row = {k: v for k, v in found[-1].items() if k != "event"}
    elif run.timed_out:
        row = {"type": type_name, "mapping": mapping, "status": "hang", "error": f"killed in phase {where}"}
    else:
        tail = run.log_tail(1500).rstrip().splitlines()
        row = {
            "type": type_name,
            "mapping": mapping,
            "status": "error",
            "error_type": "ChildDied",
            "error": f"exit code {run.returncode} in phase {where}: {tail[-1] if tail else ''}"[:300],
            "traceback": "\n".join(tail[-14:]),
        }
    row["phase"] = where
    row["seconds"] = round(run.seconds, 1)
    return row


def sweep(pairs: list[tuple[str, str]], args: argparse.Namespace, done: list[dict[str, Any]]) -> None:
    """Check every pair (``--jobs`` at a time), appending each row to ``--out`` as it comes."""
    logs = args.out.parent / "logs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out, ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(check, t, m, args.limit_s, logs, args.share, args.keep_logs) for t, m in pairs]
        for i, future in enumerate(futures, 1):
            row = future.result()
            done.append(row)
            out.write(json.dumps(row) + "\n")
            out.flush()
            detail = row.get("reason") or row.get("error") or ""
            if row["status"] in ("close", "mismatch"):
                detail = f"max diff {row.get('max_diff')}, generate equal {row.get('generate_equal')}"
            print(f"[{i}/{len(pairs)}] {row['mapping']:7} {row['type']:28} {row['status']:8} "
                  f"{row['seconds']:6.1f} s  {detail[:120]}", flush=True)  # fmt: skip


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (type, mapping): the last written."""
    by_key = {(r["type"], r["mapping"]): r for r in rows}
    return sorted(by_key.values(), key=lambda r: (r["mapping"], r["type"]))


def versions() -> dict[str, str]:
    found = {}
    for name in ("transformers", "torch", "fxoffload_hf"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "?"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--mapping", choices=[*MAPPINGS, "all"], default="causal", help="which auto mapping's types to check"
    )
    parser.add_argument("--types", help="comma-separated model types to check (default: the whole mapping)")
    parser.add_argument("--limit-s", type=float, default=180.0, help="time limit of one child, seconds")
    parser.add_argument("--jobs", type=int, default=1, help="children at once (default 1: a 2-core machine)")
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "coverage_results" / "coverage.jsonl",
        help="results as JSON lines; the markdown summary goes beside it",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=None,
        help=f"hidden size of every model (default {TINY.hidden}; heads of 64 from 256 up): a user's width",
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help=f"vocabulary size of every model (default {TINY.vocab})"
    )
    parser.add_argument(
        "--share",
        type=float,
        default=None,
        help="budget as this share of each model's weights exactly, following refusals to the floor they "
        "name (default: 0.4, with room for 2.5 of the largest weights)",
    )
    parser.add_argument(
        "--capture",
        choices=["first-call", "deferred"],
        default="first-call",
        help="first-call (default): the streamed schedule from the first call; deferred: the library's "
        "default, eager calls within the budget until capture is worth it",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="dtype of every model, saved and loaded so (default float32; checkpoints people download are "
        "mostly bfloat16)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="prompts a call carries (default 1); from 2, of different lengths, left-padded with their "
        "attention mask, as a batch of a user's prompts",
    )
    parser.add_argument(
        "--calls",
        choices=["plain", "user"],
        default="plain",
        help="plain (default): two forwards and a greedy generate; user: also what a person evaluating a "
        "model calls (a loss over labels, every layer's hidden states, a tuple output, beam search, seeded "
        "sampling), each against eager",
    )
    parser.add_argument("--resume", action="store_true", help="skip pairs already in --out")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep every child's log beside --out (else only failures')"
    )
    parser.add_argument("--report-only", action="store_true", help="only write the summary of --out")
    parser.add_argument("--table", action="store_true", help="print the markdown summary")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.batch < 1:
        parser.error("--jobs and --batch must be at least 1")
    os.environ["FXOFFLOAD_HF_CAPTURE"] = args.capture  # the children's capture mode
    os.environ[DTYPE_VARIABLE] = args.dtype
    os.environ[BATCH_VARIABLE] = str(args.batch)
    os.environ[CALLS_VARIABLE] = args.calls
    shape = TINY.with_sizes(args.hidden, args.vocab)
    os.environ[SHAPE_VARIABLE] = json.dumps(dataclasses.asdict(shape))  # the children's widths
    from harness.coverage_report import markdown

    rows = read_rows(args.out) if (args.resume or args.report_only) else []
    if not args.report_only:
        if not args.resume and args.out.exists():
            args.out.unlink()
        mappings = list(MAPPINGS) if args.mapping == "all" else [args.mapping]
        only = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else None
        seen = {(r["type"], r["mapping"]) for r in rows}
        pairs = [p for p in plan(mappings, only) if p not in seen]
        print(f"{len(pairs)} checks, {args.jobs} at a time, {args.limit_s:g} s each at most", flush=True)
        sweep(pairs, args, rows)
    header = {
        "date": dt.date.today().isoformat(),
        **versions(),
        "limit_s": args.limit_s,
        "share": args.share,
        "capture": args.capture,
        **({"shape": dataclasses.asdict(shape)} if shape != TINY else {}),
        **({"dtype": args.dtype} if args.dtype != "float32" else {}),
        **({"batch": args.batch} if args.batch > 1 else {}),
        **({"calls": args.calls} if args.calls != "plain" else {}),
    }
    text = markdown(latest(rows), header)
    table = args.out.with_suffix(".md")
    table.write_text(text)
    print(f"results: {args.out}\nsummary: {table}")
    if args.table:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
