"""The runner: runs one graph's program piece by piece under a schedule it is given.

It decides nothing: the schedule says which load starts at each piece, how far ahead loads run and on
which thread; the loader brings the weights in. Observers (a profiler, a timeline recorder) watch the
pieces run; without them the loop is the same. Each call leaves its measurements in ``last``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

from torch import fx

from fxoffload_hf.loaders import Loaded, Loader
from fxoffload_hf.planner import GraphSchedule
from fxoffload_hf.program import Program


class PieceError(RuntimeError):
    """An exception raised inside a piece, re-raised with the piece's name."""


@dataclass(frozen=True)
class PieceTiming:
    piece: int
    copy_start: float
    copy_end: float
    compute_start: float
    compute_end: float


@dataclass(frozen=True)
class CallMeasure:
    """What one call cost: seconds loading, waiting for loads and computing, bytes streamed."""

    copy_seconds: float = 0.0
    streamed_copy_seconds: float = 0.0  # of which loads that brought bytes in
    wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    streamed_bytes: int = 0
    pieces: int = 0


class Observer(Protocol):
    def piece_ran(self, runner: GraphRunner, piece: int, loaded: Loaded, fresh: bool, start: float) -> None:
        """``piece`` finished computing (it started at ``start``); ``fresh``: its load started with it."""
        ...


class GraphRunner:
    """Runs one captured graph within its schedule."""

    def __init__(self, program: Program, loader: Loader, schedule: GraphSchedule, index: int) -> None:
        self.program = program
        self.loader = loader
        self.schedule = schedule
        self.index = index  # among the model's graphs, for timelines
        self.observers: tuple[Observer, ...] = ()
        self.last = CallMeasure()

    def __call__(self, *args: Any) -> Any:
        return self.run_block([args])[0]

    def run_block(self, calls: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run the graph on each of ``calls`` (argument tuples), each piece for every call before the next
        piece loads: its weights are brought in once for all of them. Each call computes exactly what it
        computes alone (the same pieces on its own values); only the order of the work changes."""
        schedule, loader, observers = self.schedule, self.loader, self.observers
        loads, ends, reader = schedule.loads, schedule.group_ends, schedule.reader
        cuts = schedule.cuts or (False,) * len(loads)
        pieces = self.program.pieces
        envs: list[dict[fx.Node, Any]] = [
            {node: args[i] for node, i in self.program.inputs} for args in calls
        ]
        ahead: deque[Future[Loaded]] = deque()
        submitted = released = 0  # pieces whose loads were submitted, and released
        loaded, loaded_until = Loaded({}, 0.0, 0.0, 0), 0  # the load in use; one past its last piece

        def load_ahead(upto: int) -> None:
            nonlocal submitted
            # a cut load waits until the one before it is released: the two do not fit together
            while submitted < min(upto, pieces) and not (cuts[submitted] and released < submitted):
                ahead.append(reader.submit(loader.load, loads[submitted]))
                submitted = ends[submitted]

        wait_s = copy_s = streamed_copy_s = compute_s = 0.0
        streamed = 0
        try:
            for step in self.program.steps:
                if step.piece is None:
                    for env in envs:
                        env[step.node] = step.fn(
                            *[env[a] if isinstance(a, fx.Node) else a for a in step.args]
                        )
                else:
                    fresh = step.piece >= loaded_until
                    if fresh:  # else: loaded together with the piece before
                        load_ahead(step.piece + 1)
                        waited = time.perf_counter()
                        loaded = _result(ahead.popleft())
                        wait_s += time.perf_counter() - waited
                        weights = loader.ready(loaded)
                        loaded_until = ends[step.piece]
                        load_ahead(step.piece + 1 + schedule.distance)
                        copy_s += loaded.seconds
                        streamed += loaded.streamed_bytes
                        streamed_copy_s += loaded.seconds if loaded.streamed_bytes else 0.0
                    start = time.perf_counter()
                    ran = 0
                    try:
                        for env in envs:
                            call_args = [
                                weights[name] if name is not None else env[a] if isinstance(a, fx.Node) else a
                                for a, name in zip(step.args, step.weights, strict=True)
                            ]
                            env[step.node] = loader.detach(step.fn(*call_args))
                            del call_args
                            ran += 1
                    except Exception as exc:
                        raise PieceError(
                            f"piece {step.piece} ({step.node.target}) of a graph offloaded by fxoffload_hf failed: {exc}"
                        ) from exc
                    finally:
                        # the last piece of its load, or a call of it failed
                        if step.piece + 1 == loaded_until or ran < len(envs):
                            loader.release(loaded)
                            released = loaded_until
                    compute_s += time.perf_counter() - start
                    for observer in observers:
                        observer.piece_ran(self, step.piece, loaded, fresh, start)
                for value in step.frees:
                    for env in envs:
                        env.pop(value, None)
        except BaseException:
            # leave the staging arena quiet: an unfinished read must not land in the next call's piece
            wait(ahead)
            raise
        finally:
            loader.flush(reader)
        self.last = CallMeasure(copy_s, streamed_copy_s, wait_s, compute_s, streamed, pieces)
        return [self._output(args, env) for args, env in zip(calls, envs, strict=True)]

    def _output(self, args: tuple[Any, ...], env: dict[fx.Node, Any]) -> Any:
        weight_inputs = self.program.weight_inputs
        return fx.node.map_arg(
            self.program.output, lambda n: args[weight_inputs[n]] if n in weight_inputs else env[n]
        )


def _result(pending: Future[Loaded]) -> Loaded:
    """Wait for a read, waking often enough that Ctrl-C is not held up until the read ends."""
    while True:
        try:
            return pending.result(timeout=0.1)
        except TimeoutError:
            continue
