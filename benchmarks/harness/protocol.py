"""The child's side of the line protocol: JSON records on stdout behind a mark, and a token clock."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

MARK = "BENCH "  # prefix of a child's JSON lines on stdout; any other line is log


def emit(record: dict[str, Any]) -> None:
    """Send one record to the parent."""
    print(MARK + json.dumps(record), flush=True)


def parse(line: str) -> dict[str, Any] | None:
    """The record on ``line``, or None for a line of log."""
    return json.loads(line[len(MARK) :]) if line.startswith(MARK) else None


def phase(name: str) -> None:
    """Tell the parent the child entered phase ``name`` (a timeout then says where it was)."""
    emit({"event": "phase", "phase": name, "t": time.time()})


class StepClock:
    """A logits processor that only records when each new token's scores arrive (and reports it)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.time())
        emit({"event": "token", "phase": self.phase, "step": len(self.times), "t": self.times[-1]})
        return scores

    def decode_rate(self) -> float | None:
        """Decode tokens per second: one over the median time of the steps after the first token (the
        first comes from prefill). The median, not the mean: one hiccup of a shared 2-core machine would
        otherwise move a 16-step figure by several percent, in either run of a comparison."""
        return decode_rate(self.times)


def decode_rate(times: list[float]) -> float | None:
    """One over the median gap between consecutive token times; None with fewer than two."""
    if len(times) < 2:
        return None
    return 1.0 / statistics.median(b - a for a, b in zip(times, times[1:], strict=False))
