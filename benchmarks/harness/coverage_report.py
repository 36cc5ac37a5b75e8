"""The coverage sweep's markdown: counts by status, failures grouped by cause, remarks, every row."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

ORDER = ("exact", "close", "mismatch", "refused", "error", "hang", "skipped")
FAILURES = ("mismatch", "close", "refused", "error", "hang")


def markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The whole summary of ``rows`` (one per type and mapping) under ``header``'s facts."""
    facts = ", ".join(f"{k} {v}" for k, v in header.items())
    lines = [f"# fxoffload_hf coverage sweep\n\n{facts}; {len(rows)} checks.\n"]
    digests = Counter(r.get("source_digest", "not recorded") for r in rows)
    if len(digests) > 1:
        seen = ", ".join(f"{d}: {n}" for d, n in digests.items())
        lines.append(f"fxoffload_hf's sources changed during the sweep (digest: checks): {seen}.\n")
    lines.append("## Counts\n")
    lines += counts(rows)
    lines += ["", "## Failures by cause\n"]
    lines += causes(rows) or ["None."]
    lines += ["", "## Exact, with remarks\n"]
    lines += remarks(rows) or ["None."]
    lines += ["", "## Skipped (the tiny model does not build or run eagerly)\n"]
    lines += skipped(rows) or ["None."]
    lines += ["", "## Every check\n"]
    lines += every_row(rows)
    return "\n".join(lines) + "\n"


def counts(rows: list[dict[str, Any]]) -> list[str]:
    by_mapping: dict[str, Counter[str]] = defaultdict(Counter)
    for row in rows:
        by_mapping[row["mapping"]][row["status"]] += 1
    mappings = sorted(by_mapping)
    out = ["| status | " + " | ".join(mappings) + " | all |", "|---|" + "---|" * (len(mappings) + 1)]
    for status in ORDER:
        cells = [by_mapping[m][status] for m in mappings]
        if sum(cells):
            out.append(f"| {status} | " + " | ".join(map(str, cells)) + f" | {sum(cells)} |")
    return out


def normalized(message: str) -> str:
    """A message with its numbers, addresses and quoted names blurred, so that one cause is one group."""
    text = re.sub(r"0x[0-9a-f]+", "0x…", message)
    text = re.sub(r"'[^']*'", "'…'", text)
    return re.sub(r"\d+(\.\d+)?", "N", text)[:160]


def name_of(row: dict[str, Any]) -> str:
    return row["type"] if row["mapping"] == "causal" else f"{row['type']} ({row['mapping']})"


def _differing_calls(row: dict[str, Any]) -> list[str]:
    """The user battery's calls whose output differs from eager's (``--calls user``)."""
    return [name for name, equal in (row.get("user_calls") or {}).items() if equal is False]


def _difference(row: dict[str, Any]) -> str:
    if not row.get("forward_exact"):
        return "differs from eager"
    return "greedy tokens differ" if row.get("generate_equal") is False else "a user call differs"


def causes(rows: list[dict[str, Any]]) -> list[str]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["status"] not in FAILURES:
            continue
        if row["status"] in ("close", "mismatch"):
            key = row["status"], _difference(row)
        elif row["status"] == "hang":
            key = "hang", f"killed in phase {row.get('phase')}"
        else:
            key = row["status"], f"{row.get('error_type')}: {normalized(row.get('error', ''))}"
        groups[key].append(row)
    out: list[str] = []
    for (status, cause), members in sorted(
        groups.items(), key=lambda kv: (ORDER.index(kv[0][0]), -len(kv[1]))
    ):
        out.append(f"### {status}: {cause} ({len(members)})\n")
        first = members[0]
        if status in ("close", "mismatch"):
            out += [
                f"- {name_of(r)}: max diff {r.get('max_diff'):.3g}, forward exact {r.get('forward_exact')}, "
                f"greedy tokens equal {r.get('generate_equal')}, graphs {r.get('graphs')}"
                + (f", user calls differing: {', '.join(_differing_calls(r))}" if _differing_calls(r) else "")
                for r in members
            ]
        else:
            out.append("Types: " + ", ".join(f"{name_of(r)} ({r.get('phase')})" for r in members) + "\n")
            if first.get("error"):
                out.append(f"First message ({first['type']}): `{first['error']}`\n")
            if first.get("raised_in"):
                out.append(f"Raised in: `{first['raised_in']}`\n")
            if first.get("traceback"):
                out += ["```", first["traceback"], "```"]
        out.append("")
    return out


def remark_list(row: dict[str, Any]) -> list[str]:
    """What is worth a second look in an exact result."""
    notes = []
    pieces = row.get("pieces") or []
    if not pieces:
        notes.append("no graph captured")
    elif max(pieces) < 2:
        notes.append(f"pieces {pieces}: never split")
    if "disk 0 B" in (row.get("store") or ""):
        notes.append("no weight on the disk tier")
    if row.get("eager_fallback"):
        notes.append(f"eager fallback: {', '.join(row['eager_fallback'][:4])}")
    if row.get("graph_breaks"):
        notes.append(f"{row['graph_breaks']} graph breaks ({'; '.join(row.get('break_reasons', [])[:2])})")
    if row.get("budget_raised_from"):
        notes.append(f"budget raised from {row['budget_raised_from']} to {row.get('budget')}")
    if row.get("roundtrip_exact") is False:
        notes.append("Hugging Face's own reload differs from the built model")
    left_out = [name for name, equal in (row.get("user_calls") or {}).items() if isinstance(equal, str)]
    if left_out:
        notes.append(f"user calls eager cannot make: {', '.join(left_out)}")
    if row.get("restore_error"):
        notes.append(f"restore failed: {row['restore_error']}")
    return notes


def remarks(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for row in rows:
        notes = remark_list(row) if row["status"] == "exact" else []
        if notes:
            out.append(f"- {name_of(row)}: " + "; ".join(notes))
    return out


def skipped(rows: list[dict[str, Any]]) -> list[str]:
    groups: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        if row["status"] == "skipped":
            groups[normalized(row.get("reason", ""))].append(name_of(row))
    return [
        f"- {reason}: {', '.join(names)}"
        for reason, names in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    ]


def every_row(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "| type | mapping | class | status | max diff | greedy equal | graphs | pieces | breaks | fallback | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = r.get("max_diff")
        cells = [
            r["type"],
            r["mapping"],
            r.get("model_class", ""),
            r["status"],
            "" if diff is None else f"{diff:.3g}",
            "" if r.get("generate_equal") is None else str(r["generate_equal"]),
            str(r.get("graphs", "")),
            str(max(r["pieces"])) if r.get("pieces") else "",
            str(r.get("graph_breaks", "")),
            str(len(r.get("eager_fallback") or [])) if "eager_fallback" in r else "",
            str(r.get("seconds", "")),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out
