"""What a benchmark prints and keeps: the table of runs, the notes under it, the machine's facts, the JSON."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.cpu import BUSY_WARNING

MiB = 2**20
Row = dict[str, Any]
PACKAGES = ("torch", "transformers", "accelerate", "safetensors", "fxoffload_hf", "psutil")
TABLE_HEADER = (
    "mode",
    "limit",
    "prefill s",
    "decode tok/s",
    "peak private MiB",
    "peak file-backed MiB",
    "tokens = eager",
)


def fmt(value: Any, spec: str = ".2f") -> str:
    """``value`` formatted, or ``-`` for None."""
    return "-" if value is None else format(value, spec)


def decode_cell(row: Row) -> str:
    """A run's decode rate, its lower bound after a timeout, or its status."""
    if row.get("status") == "ok":
        return fmt(row.get("decode_tok_s"))
    if "decode_tok_s_lower_bound" in row:
        return f">={row['decode_tok_s_lower_bound']:.2f} ({row['status']})"
    return row.get("status", "-")


def aligned(lines: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns two spaces apart, a rule of dashes under the first line (the header)."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def sequences_equal(got: list[list[int]] | None, expected: list[list[int]] | None) -> str:
    """Whether each sequence's tokens equal the expected ones: ``yes (32/32)``, ``NO (30/32)``, or ``-``
    when either side is missing."""
    if got is None or expected is None:
        return "-"
    same = sum(a == b for a, b in zip(got, expected, strict=False))
    verdict = "yes" if same == len(expected) == len(got) else "NO"
    return f"{verdict} ({same}/{len(expected)})"


def table_lines(rows: Sequence[tuple[str, str, Row]], eager_tokens: list[int] | None) -> list[str]:
    """The table of runs, one line per (mode, limit, row); tokens compared with eager's run without a limit."""
    lines = [TABLE_HEADER]
    for mode, limit, row in rows:
        mem = row.get("memory") or {}
        equal = "-"
        if row.get("tokens") is not None and eager_tokens is not None:
            equal = "yes" if row["tokens"] == eager_tokens else "NO"
        lines.append(
            (
                mode,
                limit,
                fmt(row.get("prefill_s"), ".3f"),
                decode_cell(row),
                fmt(mem.get("peak_anon") and mem["peak_anon"] / MiB, ".0f"),
                fmt(mem.get("peak_file") and mem["peak_file"] / MiB, ".0f"),
                equal,
            )
        )
    return aligned(lines)


def note_lines(
    report: dict[str, Any], rows: Sequence[tuple[str, str, Row]], bound: float | None
) -> list[str]:
    """What goes under the table: each mode's rates by round, the disk bound, failures, busy CPUs, and
    fxoffload's engine figures."""
    out = []
    for mode, row in report["free"].items():
        rates = ", ".join(fmt(r) for r in row.get("decode_tok_s_rounds", []))
        if rates:
            out.append(f"{mode} without a limit, decode tok/s by round: {rates} (the median run is shown)")
    out.append(
        "(decode tok/s = 1 / median decode step time; peak private = max RssAnon, peak file-backed = max RssFile, sampled every 20 ms over the timed prefill "
        "and generate; both include the import baseline)"
    )
    if bound is not None:
        out.append(
            f"{'disk bound':<10}  {report['limit']['limit_bytes'] / MiB:.0f} MiB  decode tok/s <= {bound:.2f}"
        )
    for mode, limit, row in rows:
        if row.get("status") != "ok":
            last = (row.get("log_tail") or "").strip().splitlines()[-1:]
            out.append(f"note: {mode} (limit {limit}): {row['status']}" + (f": {last[0]}" if last else ""))
        if row.get("foreign_cpu_share", 0) > BUSY_WARNING:
            out.append(
                f"WARNING: {mode} (limit {limit}): other processes used {row['foreign_cpu_share']:.0%} of the CPUs "
                "meanwhile; its figures are not those of an idle machine"
            )
        if row.get("engine"):
            out.append(
                f"fxoffload engine (limit {limit}): {row['engine']['store']}; measured: {row['engine']['measure_delta']}"
            )
    return out


def machine() -> dict[str, Any]:
    """Platform, CPUs, RAM, load and package versions, for the report."""
    import psutil

    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "loadavg_at_start": os.getloadavg(),
        "versions": versions,
    }


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write ``report`` to ``path`` (folders made as needed), indented."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def header(config: dict[str, Any], facts: dict[str, Any], seed: int) -> dict[str, Any]:
    """What every benchmark's JSON report opens with: when, how it was run, where, and the model."""
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "machine": machine(),
        "model": {"class": "LlamaForCausalLM", "config": config, "seed": seed, **facts},
    }
