"""The runner on a synthetic program with a recording loader: order of loads, releases and computes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import fx

from fxoffload_hf.graphs import GraphFacts
from fxoffload_hf.loaders import InlineReader, Loaded, LoadSpec, ThreadedReader
from fxoffload_hf.partition import partition_graph
from fxoffload_hf.planner import GraphSchedule
from fxoffload_hf.program import build_program
from fxoffload_hf.runner import GraphRunner, PieceError
from fxoffload_hf.weight_record import WeightRecord

WIDTH, DEPTH = 8, 5


def chain(x, *weights):
    for w in weights:
        x = torch.tanh(x @ w)
    return x


class RecordingLoader:
    """Serves each spec's weights from a dict and logs what happens, in order."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values
        self.events: list[tuple[str, tuple[str, ...]]] = []

    def load(self, spec: LoadSpec) -> Loaded:
        names = tuple(r.name for r in spec.held)
        return Loaded({n: self.values[n] for n in names}, 0.0, 0.0, 0)

    def ready(self, loaded: Loaded) -> dict[str, torch.Tensor]:
        return loaded.tensors

    def detach(self, value):
        return value

    def release(self, loaded: Loaded) -> None:
        self.events.append(("release", tuple(loaded.tensors)))

    def flush(self, reader) -> None:
        self.events.append(("flush", ()))


class SubmitLog:
    """A reader that logs each load as the runner submits it (on the calling thread), then runs it."""

    def __init__(self, reader, events: list[tuple[str, tuple[str, ...]]]) -> None:
        self.reader, self.events = reader, events

    def submit(self, fn, spec):
        self.events.append(("load", tuple(r.name for r in spec.held)))
        return self.reader.submit(fn, spec)


@pytest.fixture
def setup():
    gm = fx.symbolic_trace(lambda x, w0, w1, w2, w3, w4: chain(x, w0, w1, w2, w3, w4))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights = {n: i for i, n in enumerate(placeholders) if n.name.startswith("w")}
    facts = GraphFacts(
        names={n: n.name for n in weights},
        positions=weights,
        weight_bytes=dict.fromkeys(weights, 100),
        activation_bytes=0,
        lookups=frozenset(),
    )
    partition = partition_graph(gm.graph, facts.weight_bytes, 100)
    program = build_program(gm, partition, facts, None)
    values = {
        f"w{i}": torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(DEPTH)
    }
    x = torch.randn(2, WIDTH)
    return program, values, x


def schedule_for(program, ends, distance, reader, loader):
    loads = [None] * program.pieces
    start = 0
    while start < program.pieces:
        names = [n for p in range(start, ends[start]) for n in program.piece_names[p]]
        records = tuple(WeightRecord(n, (WIDTH, WIDTH), torch.float32) for n in names)
        loads[start] = LoadSpec(held=records)
        start = ends[start]
    return GraphSchedule(tuple(loads), tuple(ends), distance, SubmitLog(reader, loader.events))


def run(program, loader, schedule, x, values):
    runner = GraphRunner(program, loader, schedule, index=0)
    out = runner(x, *(torch.full((WIDTH, WIDTH), float("nan")) for _ in values))  # ghosts: never read
    return runner, out[0] if isinstance(out, tuple | list) else out


@pytest.mark.parametrize("distance", [0, 1, 3])
def test_each_piece_is_loaded_before_it_runs_and_released_after(setup, distance):
    program, values, x = setup
    assert program.pieces == DEPTH
    loader = RecordingLoader(values)
    ends = tuple(range(1, DEPTH + 1))
    reader = InlineReader() if distance == 0 else ThreadedReader()
    runner, out = run(program, loader, schedule_for(program, ends, distance, reader, loader), x, values)
    assert torch.equal(out, chain(x, *values.values()))
    loads = [e for e in loader.events if e[0] == "load"]
    assert [names for _, names in loads] == [(f"w{i}",) for i in range(DEPTH)]
    for piece in range(DEPTH):
        released = loader.events.index(("release", (f"w{piece}",)))
        loaded_before = sum(1 for kind, _ in loader.events[:released] if kind == "load")
        assert loaded_before == min(piece + 1 + distance, DEPTH)
    assert loader.events[-1] == ("flush", ())
    assert runner.last.pieces == DEPTH


def test_grouped_pieces_share_one_load_and_one_release(setup):
    program, values, x = setup
    loader = RecordingLoader(values)
    ends = (2, 2, 5, 5, 5)
    _, out = run(program, loader, schedule_for(program, ends, 0, InlineReader(), loader), x, values)
    assert torch.equal(out, chain(x, *values.values()))
    assert loader.events == [
        ("load", ("w0", "w1")),
        ("release", ("w0", "w1")),
        ("load", ("w2", "w3", "w4")),
        ("release", ("w2", "w3", "w4")),
        ("flush", ()),
    ]


def test_a_failing_piece_is_named_its_load_released_and_reads_ahead_drained(setup):
    program, values, x = setup
    loader = RecordingLoader(values)
    steps = tuple(
        replace(s, fn=lambda *a: (_ for _ in ()).throw(ValueError("boom"))) if s.piece == 1 else s
        for s in program.steps
    )
    broken = replace(program, steps=steps)
    schedule = schedule_for(program, tuple(range(1, DEPTH + 1)), 2, ThreadedReader(), loader)
    with pytest.raises(PieceError, match="piece 1 .*boom") as info:
        GraphRunner(broken, loader, schedule, index=0)(x, *values.values())
    assert isinstance(info.value.__cause__, ValueError)
    assert ("release", ("w1",)) in loader.events and loader.events[-1] == ("flush", ())
    assert sum(1 for kind, _ in loader.events if kind == "load") == 4  # pieces 0..3 were read: drained


def test_observers_see_every_piece_with_its_load(setup):
    program, values, x = setup
    seen: list[tuple[int, bool]] = []

    class Watch:
        def piece_ran(self, runner, piece, loaded, fresh, start):
            seen.append((piece, fresh))

    loader = RecordingLoader(values)
    runner = GraphRunner(
        program, loader, schedule_for(program, (2, 2, 5, 5, 5), 0, InlineReader(), loader), index=0
    )
    runner.observers = (Watch(),)
    runner(x, *values.values())
    assert seen == [(0, True), (1, False), (2, True), (3, False), (4, False)]


@pytest.mark.parametrize("distance", [1, 3])
def test_a_cut_load_waits_until_the_load_before_it_is_released(setup, distance):
    program, values, x = setup
    loader = RecordingLoader(values)
    cuts = (False, False, True, True, False)  # piece 2 does not fit beside 1, nor 3 beside 2
    schedule = replace(
        schedule_for(program, tuple(range(1, DEPTH + 1)), distance, ThreadedReader(), loader), cuts=cuts
    )
    _, out = run(program, loader, schedule, x, values)
    assert torch.equal(out, chain(x, *values.values()))
    events = loader.events
    for piece, cut in enumerate(cuts):
        loaded = events.index(("load", (f"w{piece}",)))
        if cut:  # the piece before is released before this one is loaded: never both held
            assert events.index(("release", (f"w{piece - 1}",))) < loaded
    # the uncut boundary still overlaps: piece 1 is loaded while piece 0 is held
    assert events.index(("load", ("w1",))) < events.index(("release", ("w0",)))
