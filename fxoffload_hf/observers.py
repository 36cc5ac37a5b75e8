"""Observers of a runner's pieces: the profiler whose measurements feed the schedule, and the timeline
recorder. A runner calls them after each piece; a runner without observers runs the same loop."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fxoffload_hf.loaders import Loaded
from fxoffload_hf.runner import GraphRunner, PieceTiming
from fxoffload_hf.schedule import PieceProfile


@dataclass
class TraceEvent:
    """One piece run, for timelines: which graph and call, bytes streamed, and its timing."""

    graph: int
    call: int
    streamed_bytes: int
    timing: PieceTiming
    alone: bool = False  # its load waited for the piece before it: a copy not hidden by design


def _timing(piece: int, loaded: Loaded, fresh: bool, start: float) -> PieceTiming:
    if not fresh:  # loaded together with the piece before: the copy counts there
        return PieceTiming(piece, start, start, start, time.perf_counter())
    return PieceTiming(piece, loaded.started, loaded.started + loaded.seconds, start, time.perf_counter())


class Profiler:
    """Measures each piece's copy and compute seconds during one call; ``profile`` is the result.

    ``sync`` waits for the device to finish the piece's work (CUDA computes asynchronously), so that
    the compute time is the piece's own.
    """

    def __init__(self, weight_sizes: dict[str, int], sync: Callable[[], None]) -> None:
        self.weight_sizes = weight_sizes
        self.sync = sync
        self.profile: list[PieceProfile] = []

    def piece_ran(self, runner: GraphRunner, piece: int, loaded: Loaded, fresh: bool, start: float) -> None:
        self.sync()
        timing = _timing(piece, loaded, fresh, start)
        names = runner.program.piece_names[piece]
        self.profile.append(
            PieceProfile(
                weights=names,
                weight_bytes={n: self.weight_sizes[n] for n in names},
                copy_seconds=timing.copy_end - timing.copy_start,
                compute_seconds=timing.compute_end - timing.compute_start,
            )
        )


class TraceRecorder:
    """Appends a ``TraceEvent`` per piece run to ``events``; ``calls`` counts the model's calls so far."""

    def __init__(self, events: list[TraceEvent], calls: Callable[[], int]) -> None:
        self.events = events
        self.calls = calls

    def piece_ran(self, runner: GraphRunner, piece: int, loaded: Loaded, fresh: bool, start: float) -> None:
        streamed = loaded.streamed_bytes if fresh else 0
        timing = _timing(piece, loaded, fresh, start)
        cuts = runner.schedule.cuts
        alone = fresh and piece < len(cuts) and cuts[piece]
        self.events.append(TraceEvent(runner.index, self.calls(), streamed, timing, alone))
