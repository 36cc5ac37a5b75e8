"""Planning: a captured graph, the store's facts and the budget in; an immutable plan out.

Two steps, both free of threads and devices, so ``fxoffload-hf plan`` runs them on the meta device:

- ``partition_for_budget``: the pieces of one graph, sized from the memory model and the policy;
- ``plan_model``: for every graph of a model, with the weights where the store has them now, the staging
  arena, the prefetch distance, the load groups and a ``LoadSpec`` per load (the loader of each weight),
  as a ``ModelPlan`` the engine swaps in whole.

``schedule.choose_resident`` turns a measured profile into the set of weights worth keeping; the engine
hands it to the store, and plans again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from torch import fx

from fxoffload_hf.loaders import ROWS_WHERE_THEY_LIE, LoadSpec, Reader, Way, way_of
from fxoffload_hf.memory_model import BudgetTooSmallError, MemoryModel, cuts_for, piece_bytes, window_bytes
from fxoffload_hf.partition import Partition, partition_graph
from fxoffload_hf.schedule import PieceProfile, choose_distance, load_groups
from fxoffload_hf.weight_record import Tier, WeightRecord


def sizes_for_budget(
    weight_bytes: Mapping[fx.Node, int],
    names: Mapping[fx.Node, str],
    lookups: frozenset[str],
    records: Mapping[str, WeightRecord],
    device_type: str,
) -> dict[fx.Node, int]:
    """What each weight of a graph takes in flight: its bytes, or nothing for a table read by rows."""
    return {
        w: 0 if read_by_rows(records[names[w]], lookups, device_type) else b for w, b in weight_bytes.items()
    }


def partition_for_budget(
    graph: fx.Graph,
    weight_bytes: Mapping[fx.Node, int],
    activations: int,
    memory: MemoryModel,
    policy: str,
    names: Mapping[fx.Node, str] | None = None,
) -> Partition:
    """Partition a captured graph for ``memory``'s budget under ``policy``.

    Raises:
        BudgetTooSmallError: the largest unsplittable weight group alone plus the activations does not
            fit; the message names the smallest budget that works.
    """
    room = memory.room(activations)
    if room is None:
        return partition_graph(graph, weight_bytes, max(sum(weight_bytes.values()), 1))
    target = memory.piece_target(policy, activations)
    try:
        # an unsplittable group larger than the target sits alone in its piece; one larger than half the
        # room streams without overlap (the plan cuts around it), as long as it fits the room by itself
        result = partition_graph(graph, weight_bytes, target, max_atom=max(room, target), names=names)
    except BudgetTooSmallError as exc:
        smallest = memory.smallest_budget(exc.smallest_budget, activations)
        raise memory.too_small(smallest, activations, str(exc)) from None
    # the floor: the largest piece alone beside the activations and the small tensors
    largest = max((piece_bytes(weight_bytes[w] for w in p.weights) for p in result.pieces), default=0)
    if not memory.fits(activations=activations, in_flight=largest):
        raise memory.too_small(memory.need(activations=activations, in_flight=largest), activations)
    return result


@dataclass(frozen=True)
class GraphSchedule:
    """How one graph's pieces are loaded: which load starts at each piece, how far ahead, on what thread."""

    loads: tuple[LoadSpec | None, ...]  # per piece: the load that starts there (None inside a group)
    group_ends: tuple[int, ...]  # per piece: one past the last piece loaded with it
    distance: int  # loads started ahead of the one the compute waits for
    reader: Reader
    cuts: tuple[bool, ...] = ()  # per piece: its load waits until the load before it is released


@dataclass(frozen=True)
class GraphPlan:
    """The schedules of one graph: loads started ahead of the compute (on the read-ahead thread; on CUDA,
    where no file is read, queued from the calling thread), and (CPU only) loads on the calling thread,
    for when the last call's loads cost little beside its compute."""

    ahead: GraphSchedule
    inline: GraphSchedule | None

    def schedule(self, inline: bool) -> GraphSchedule:
        """The inline schedule when asked for and there is one, else the threaded one."""
        return self.inline if inline and self.inline is not None else self.ahead


@dataclass(frozen=True)
class ModelPlan:
    """Everything the runners of one model need, made for one placement of its weights."""

    version: int  # the store's version it was made for
    arena_bytes: int  # staging arena: two consecutive loads of staged weights (one, across a cut)
    in_flight_bytes: int  # what the streamed pieces in flight hold at most (arena or mapped pages)
    graphs: tuple[GraphPlan, ...]


@dataclass(frozen=True)
class GraphInput:
    """What planning needs of one graph: its pieces' weights, and its profile once measured."""

    piece_names: tuple[tuple[str, ...], ...]
    lookups: frozenset[str]
    profile: tuple[PieceProfile, ...] = ()


def plan_model(
    graphs: Sequence[GraphInput],
    records: Mapping[str, WeightRecord],
    *,
    version: int,
    memory: MemoryModel,
    activations: int,
    device_type: str,
    policy: str,
    threaded: Reader,
    inline: Reader | None = None,
    held: Callable[[Sequence[WeightRecord]], int] | None = None,
) -> ModelPlan:
    """Plan every graph of a model for the weights' current tiers (``records``); ``held`` says what the
    weights kept hold where the model computes (``WeightStore.held_bytes``; by default their bytes)."""
    per_graph = [[[records[n] for n in names] for names in g.piece_names] for g in graphs]
    room = memory.room(activations)
    flight_room = None if room is None else room - kept_bytes(records, held)
    cuts, streamed = [], []
    for g, pieces in zip(graphs, per_graph, strict=True):
        whole = {r.name for piece in pieces for r in piece if not read_by_rows(r, g.lookups, device_type)}
        moving = [_bytes(piece, lambda r: r.tier.streams and r.name in whole) for piece in pieces]  # noqa: B023
        cuts.append(cuts_for(moving, flight_room))
        streamed.append([_bytes(piece, lambda r: r.tier.from_file and r.name in whole) for piece in pieces])  # noqa: B023
    staged = [
        [
            _bytes(piece, lambda r: way_of(r, device_type, rows_only=r.name in g.lookups) is Way.STAGED)  # noqa: B023
            for piece in pieces
        ]
        for g, pieces in zip(graphs, per_graph, strict=True)
    ]
    arena = max((window_bytes(s, 2, c) for s, c in zip(staged, cuts, strict=True) if any(s)), default=0)
    distances = [
        1
        if arena or room is None or policy != "auto" or not g.profile or any(c)
        else _distance(g.profile, records, room)
        for g, c in zip(graphs, cuts, strict=True)
    ]
    in_flight = max(
        (window_bytes(s, d + 1, c) for s, d, c in zip(streamed, distances, cuts, strict=True) if any(s)),
        default=0,
    )
    inline_reader = inline if device_type == "cpu" else None
    plans = []
    for graph, pieces, sizes, distance, cut, staged_sizes in zip(
        graphs, per_graph, streamed, distances, cuts, staged, strict=True
    ):
        singles = tuple(range(1, len(pieces) + 1))
        build = _loads_builder(pieces, device_type, graph.lookups)
        inline_schedule = None
        if inline_reader is not None:
            # staged pieces share the arena two at a time: those load one by one
            groups = singles if arena else tuple(load_groups(sizes, in_flight))
            inline_schedule = GraphSchedule(build(groups), groups, 0, inline_reader, cut)
        # on CUDA, loads that read no file only queue copies: no thread needed (``loaders``)
        reader = inline if inline is not None and device_type != "cpu" and not any(staged_sizes) else threaded
        plans.append(
            GraphPlan(GraphSchedule(build(singles), singles, distance, reader, cut), inline_schedule)
        )
    return ModelPlan(version, arena, in_flight, tuple(plans))


def read_by_rows(record: WeightRecord, lookups: frozenset[str], device_type: str) -> bool:
    """A table the graph only looks rows up in, read where it lies (mapped file pages; on CUDA also host
    RAM): only the rows looked up are brought in, so the table never counts whole."""
    return record.name in lookups and way_of(record, device_type, rows_only=True) in ROWS_WHERE_THEY_LIE


def kept_bytes(
    records: Mapping[str, WeightRecord], held: Callable[[Sequence[WeightRecord]], int] | None = None
) -> int:
    """Bytes of the weights kept where the model computes between calls (as ``held`` counts them)."""
    seen = {id(r): r for r in records.values()}
    kept = [r for r in seen.values() if r.tier in (Tier.DEVICE, Tier.MAPPED)]
    return held(kept) if held else sum(r.footprint for r in kept)


def _bytes(piece: list[WeightRecord], counted: Callable[[WeightRecord], bool]) -> int:
    return piece_bytes(r.disk.nbytes for r in piece if r.disk is not None and counted(r))


def _loads_builder(
    pieces: list[list[WeightRecord]], device_type: str, lookups: frozenset[str]
) -> Callable[[tuple[int, ...]], tuple[LoadSpec | None, ...]]:
    def build(ends: tuple[int, ...]) -> tuple[LoadSpec | None, ...]:
        loads: list[LoadSpec | None] = [None] * len(pieces)
        start = 0
        while start < len(pieces):
            records = [r for piece in pieces[start : ends[start]] for r in piece]
            loads[start] = LoadSpec.build(records, device_type, lookups, side=start % 2)
            start = ends[start]
        return tuple(loads)

    return build


def _distance(profile: Sequence[PieceProfile], records: Mapping[str, WeightRecord], room: int) -> int:
    """How far ahead to load a graph's pieces: from its profile, with what stays resident taken out, in the
    room the resident weights leave."""
    streamed_profiles = []
    for piece in profile:
        streamed = {w: b for w, b in piece.weight_bytes.items() if records[w].tier.streams}
        share = sum(streamed.values()) / max(piece.nbytes, 1)
        streamed_profiles.append(
            PieceProfile(tuple(streamed), streamed, piece.copy_seconds * share, piece.compute_seconds)
        )
        room -= piece.nbytes - sum(streamed.values())
    return choose_distance(streamed_profiles, room)
