"""Paired, interleaved rounds: every mode once a round, so a slow spell of a shared machine weighs on all.

Per mode the median run is kept; a comparison of two modes takes the median of each round's ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]
RATE = "decode_tok_s"
ROUND_RATES = "decode_tok_s_rounds"


def interleave(modes: Sequence[str], rounds: int, run: Callable[[str, int], Row]) -> dict[str, list[Row]]:
    """``run(mode, round_index)`` for every mode in every round, modes in order within a round."""
    runs: dict[str, list[Row]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        for mode in modes:
            runs[mode].append(run(mode, round_index))
    return runs


def median_run(rows: list[Row], key: str = RATE) -> Row:
    """The run with the median ``key`` among the rounds of one mode, with every round's value under
    ``key + "_rounds"`` (None for a failed round); the first run when none has the figure."""
    done = sorted((r for r in rows if r.get(key)), key=lambda r: r[key])
    if not done:
        return rows[0]
    chosen = dict(done[(len(done) - 1) // 2])
    chosen[key + "_rounds"] = [r.get(key) for r in rows]
    return chosen


def paired_ratios(values: Sequence[float | None], peers: Sequence[float | None]) -> list[float]:
    """Each round's ``value / peer``, for the rounds where both have a (non-zero) figure."""
    return [a / b for a, b in zip(values, peers, strict=False) if a and b]


def paired_ratio(row: Row, peer: Row, key: str = ROUND_RATES) -> float | None:
    """The median over rounds of ``row``'s rate over the peer's in the same round; None with fewer than two
    paired rounds. Runs of one round follow each other within a minute: a slow spell of a shared machine
    then weighs on both sides of a ratio, not on one mode's median only."""
    pairs = paired_ratios(row.get(key, []), peer.get(key, []))
    return statistics.median(pairs) if len(pairs) > 1 else None
