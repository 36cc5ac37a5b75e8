"""fxoffload_hf's figures of a model, read only through ``fxoffload_hf.engine_of(model).report()``."""

from __future__ import annotations

import sys
from typing import Any


def engine_report(model: Any) -> dict[str, Any] | None:
    """The engine's report of ``model``, or None for a model fxoffload_hf does not run."""
    if "fxoffload_hf" not in sys.modules:
        return None
    import fxoffload_hf

    try:
        return fxoffload_hf.engine_of(model).report()
    except ValueError:
        return None


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Counters of ``after`` less those of ``before`` (the share of hidden copy time is no counter)."""
    return {k: round(after[k] - before[k], 4) for k in after if k != "hidden_copy_share"}


def measured(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The engine's figures for a row: counters at the end, their rise over the timed part, the store."""
    return {
        "stats": after["stats"],
        "measure_delta": stats_delta(before["stats"], after["stats"]),
        "store": after["store"],
    }
