"""Counters of one offloaded model over its engine's lifetime: calls, graph runs, bytes streamed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxoffload_hf.runner import CallMeasure


@dataclass
class Stats:
    """Counters over the engine's lifetime."""

    calls: int = 0
    runs: int = 0  # of graphs: fewer than calls where blocks of calls ran together (``run_together``)
    pieces_run: int = 0
    bytes_streamed: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    graphs: int = 0
    eager_calls: int = 0  # run before capture (``capture="deferred"``)

    def add_call(self, measure: CallMeasure, calls: int = 1) -> None:
        self.calls += calls
        self.runs += 1
        self.pieces_run += measure.pieces
        self.bytes_streamed += measure.streamed_bytes
        self.copy_seconds += measure.streamed_copy_seconds
        self.wait_seconds += measure.wait_seconds

    @property
    def hidden_copy_share(self) -> float:
        """Share of copy time that ran behind compute (1.0 when nothing was copied)."""
        if self.copy_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)

    def since(self, earlier: Stats) -> Stats:
        """What was counted after ``earlier`` (a copy of these counters); ``graphs`` stays the total."""
        return Stats(
            calls=self.calls - earlier.calls,
            runs=self.runs - earlier.runs,
            pieces_run=self.pieces_run - earlier.pieces_run,
            bytes_streamed=self.bytes_streamed - earlier.bytes_streamed,
            copy_seconds=self.copy_seconds - earlier.copy_seconds,
            wait_seconds=self.wait_seconds - earlier.wait_seconds,
            graphs=self.graphs,
            eager_calls=self.eager_calls - earlier.eager_calls,
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "graph_runs": self.runs,
            "graphs": self.graphs,
            "eager_calls": self.eager_calls,
            "pieces_run": self.pieces_run,
            "bytes_streamed": self.bytes_streamed,
            "copy_seconds": round(self.copy_seconds, 4),
            "wait_seconds": round(self.wait_seconds, 4),
            "hidden_copy_share": round(self.hidden_copy_share, 4),
        }
