"""The project's targets as ratios: each printed as one line (value, target, verdict) and returned."""

from __future__ import annotations

from harness.report import fmt
from harness.rounds import RATE, Row, paired_ratio


def ratio_line(name: str, value: float | None, target: str, ok: bool | None, note: str = "") -> Row:
    """Print one target's line; its record for the JSON (``pass`` None when it could not be judged)."""
    verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    print(f"  {name:<48} {fmt(value, '.3f'):>8}   target {target:<8} {verdict}{note}")
    return {"name": name, "value": value, "target": target, "pass": ok, "note": note.strip()}


def within(name: str, value: float, *, least: float | None = None, most: float | None = None) -> Row:
    """``value`` against a floor ``least`` or a ceiling ``most``: printed and returned."""
    if least is not None:
        return ratio_line(name, value, f">= {least:g}", value >= least)
    assert most is not None, "within() needs least or most"
    return ratio_line(name, value, f"<= {most:g}", value <= most)


def rate(row: Row | None, key: str = RATE) -> float | None:
    """A run's rate under ``key`` (decode tokens/s by default), or its lower bound (``key +
    "_lower_bound"``) after a timeout."""
    if row is None:
        return None
    return row.get(key) if row.get("status") == "ok" else row.get(key + "_lower_bound")


def at_least(
    name: str, row: Row | None, peer_row: Row | None, peer: float | None, least: float, key: str = RATE
) -> Row:
    """``row``'s rate (under ``key``) over ``peer`` (a rate) must be at least ``least``. With ``peer_row``
    whose rounds ran beside ``row``'s, the median of the rounds' ratios is judged (the ratio of medians goes
    in the note). A run that failed fails; a run that timed out is judged on its lower bound."""
    target = f">= {least:g}"
    if row is None or peer is None:
        return ratio_line(name, None, target, None)
    value = rate(row, key)
    if value is None:
        return ratio_line(name, None, target, False, f" (fxoffload: {row['status']})")
    note = "" if row.get("status") == "ok" else f" (fxoffload lower bound: {row['status']})"
    value /= peer
    paired = paired_ratio(row, peer_row, key + "_rounds") if peer_row is not None else None
    if paired is not None:
        note += f" (median of the {len(row[key + '_rounds'])} rounds' ratios; ratio of medians {value:.3f})"
        value = paired
    return ratio_line(name, value, target, value >= least, note)


def offload_targets(
    free: dict[str, Row], limited: dict[str, Row], bound: float | None, budget: int
) -> list[Row]:
    """Each fxoffload mode run ("fxoffload", the schedule captured at the warm-up, and the default
    "fxoffload-deferred"; the first when neither ran) against eager and accelerate, without and under the
    limit, and its private memory against the budget: printed and returned. A failed run fails its
    targets."""
    modes = [m for m in ("fxoffload", "fxoffload-deferred") if m in free or m in limited] or ["fxoffload"]
    return [row for mode in modes for row in _mode_targets(mode, free, limited, bound, budget)]


def _mode_targets(
    mode: str, free: dict[str, Row], limited: dict[str, Row], bound: float | None, budget: int
) -> list[Row]:
    fx = free.get(mode)
    out = [
        at_least(f"decode tok/s {mode} / eager", fx, free.get("eager"), rate(free.get("eager")), 0.9),
        at_least(
            f"decode tok/s {mode} / accelerate",
            fx,
            free.get("accelerate"),
            rate(free.get("accelerate")),
            1.5,
        ),
    ]
    if limited:
        fx = limited.get(mode)
        out += [
            at_least(f"under limit: {mode} / eager", fx, None, rate(limited.get("eager")), 1.0),
            at_least(f"under limit: {mode} / accelerate", fx, None, rate(limited.get("accelerate")), 1.0),
            at_least(f"under limit: {mode} / disk bound", fx, None, bound, 0.9),
        ]
    mem = (free.get(mode) or {}).get("memory")
    if mem:
        rise = (mem["peak_anon"] - mem["after_import"]["RssAnon"]) / budget
        out.append(within(f"peak private rise over import / budget ({mode})", rise, most=1.15))
        kept = (mem["measure_start"]["RssAnon"] - mem["after_import"]["RssAnon"]) / budget
        out.append(ratio_line("  of which held after warm-up / budget", kept, "(info)", None))
    return out
