"""Weights too large for a piece, streamed in tiles of rows and computed with bit for bit as whole.

A projection ``linear(x, W)`` whose weight cannot stream beside its neighbour (an output head of a large
vocabulary, a fused projection) is split along its output rows into tiles, each a weight of its own that
streams like any other; the projection becomes a chain of tile products (``tile_products``), each
exact in its columns. On the CPU a tile's product is computed with the whole weight's shape until the
tile alone is seen to round the same (``tile_linear``), so a tile is counted as held twice (its copy in
the whole-shaped buffer: ``WeightRecord.footprint``); a tile the model converts to another dtype before
its projection (``projections``) with its converted copies too. Tiles take their rows in multiples of
``ROW_GROUP`` where they can: MKL's kernels take rows in groups, and tiles that start and end on a
group's edge compute alone as the whole does.

On CUDA a device buffer has no shared zero page: each tile is computed alone (``tile_linear_alone``),
as its own product of the tile's rows. cuBLAS too picks its kernel by shape, so there a tiled projection
rounds differently from the whole (one bf16 ulp in a 64-token prefill on an H200); so on CUDA a weight
is tiled only when it cannot fit the budget even alone, where nothing else would run, and one that
cannot stream beside another piece streams alone (``too_large_for``).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from fxoffload_hf import expert_tiles
from fxoffload_hf.capture import ghost_for
from fxoffload_hf.graphs import (
    GraphFacts,
    activation_peak,
    tile_placeholders,
    traced_value,
    value_bytes,
)
from fxoffload_hf.memory_model import MemoryModel, format_bytes
from fxoffload_hf.planner import sizes_for_budget
from fxoffload_hf.progress import report
from fxoffload_hf.projections import blocking_use, compute_dtype, conversion_of, describe, projections
from fxoffload_hf.tile_products import TileOp, tile_linear, tile_linear_alone
from fxoffload_hf.weight_record import WeightRecord
from fxoffload_hf.weights import WeightStore

_PAGE = mmap.PAGESIZE
# rows a tile takes in multiples of, where it can (MKL here takes a matrix-vector product's rows in pairs:
# an odd tile rounds its last row apart; a group of 16 leaves room for wider kernels)
ROW_GROUP = 16
# A weight is cut into at most this many tiles: each is a piece with a load, a schedule entry and a
# product of its own, and planning weighs every piece against the others, so that budgets a few hundred
# KiB above the floor would cut a 64 MiB projection into thousands of tiles and take minutes to plan
# (measured: 7,646 pieces, six minutes); the floor this sets is a weight's 256th beside the rest
MOST_GRAPH_TILES = 256


def fewest_rows(shape: Sequence[int], itemsize: int) -> int:
    """The rows of a weight of ``shape`` that fill whole pages: tiles take multiples of them, so a tile's
    buffer pages can be given back after its call."""
    return _PAGE // math.gcd(math.prod(shape[1:]) * itemsize, _PAGE)


def fewest_tile_rows(shape: Sequence[int], itemsize: int) -> int:
    """The fewest rows a tile of a weight of ``shape`` takes: whole pages (``fewest_rows``), and enough
    that the weight makes at most ``MOST_GRAPH_TILES`` tiles."""
    step = fewest_rows(shape, itemsize)
    need = max(step, -(-shape[0] // MOST_GRAPH_TILES))
    group = math.lcm(step, ROW_GROUP)
    unit = group if need >= group else step  # as ``rows_per_tile`` rounds
    return min(shape[0], -(-need // unit) * unit)


def graph_tile_rows(shape: Sequence[int], itemsize: int, target_bytes: int) -> int:
    """``rows_per_tile``, or 0 where that would cut the weight into more than ``MOST_GRAPH_TILES`` tiles."""
    rows = rows_per_tile(shape, itemsize, target_bytes)
    return rows if rows >= fewest_tile_rows(shape, itemsize) else 0


def rows_per_tile(shape: Sequence[int], itemsize: int, target_bytes: int) -> int:
    """How many rows a tile of a weight of ``shape`` takes to stay within ``target_bytes``: a multiple of
    ``fewest_rows`` (0 if even those do not fit), and of ``ROW_GROUP`` where the target holds one, all
    of them at most."""
    step = fewest_rows(shape, itemsize)
    rows = max(target_bytes, 0) // (math.prod(shape[1:]) * itemsize)
    group = math.lcm(step, ROW_GROUP)
    rows = rows // group * group if rows >= group else rows // step * step
    return min(rows, shape[0])


def can_tile(weight: fx.Node, shape: Sequence[int]) -> bool:
    """Whether a weight of ``shape`` can stream in tiles: of rows where it is 2-D and every use of it a
    projection by it (or by its conversion to another dtype: ``projections``) or a row lookup; of whole experts where it is a stacked expert weight that only
    grouped products use (``expert_tiles``)."""
    return (len(shape) == 2 and blocking_use(weight) is None) or expert_tiles.can_tile_experts(weight, shape)


def copied_to_compute(device_type: str) -> bool:
    """Whether a tile is copied into a whole-shaped buffer to compute (on the CPU), so held twice."""
    return device_type == "cpu"


def too_large_for(room: int, device_type: str) -> int:
    """Weights larger than this are tiled: on the CPU those that cannot stream beside another piece (two
    in flight in ``room``), on CUDA only those that cannot stream even alone (exactness first)."""
    return room // 2 if copied_to_compute(device_type) else room


def tile_op(device_type: str) -> TileOp:
    """How a tile computes on ``device_type``: in a whole-shaped buffer on the CPU, alone on CUDA."""
    return tile_linear if copied_to_compute(device_type) else tile_linear_alone


def times_held(device_type: str, shape: Sequence[int] = ()) -> int:
    """How many times the bytes of a tile of a weight of ``shape`` are held while it computes: a tile of
    rows twice on the CPU (streamed, and copied into the whole-shaped buffer), once on CUDA; a tile of a
    stacked weight's experts once (``expert_tiles``: never copied)."""
    return 2 if copied_to_compute(device_type) and len(shape) != 3 else 1


def tile_share(shape: Sequence[int]) -> int:
    """The share of the room for weights a tile of a weight of ``shape`` is sized to: two in flight, a
    tile of rows counted as held twice on every device (exactness first), a tile of experts once. Half
    that share where even two do not fit (a tile that streams alone)."""
    return 2 if len(shape) == 3 else 4


def smallest_tile_bytes(
    shape: Sequence[int], itemsize: int, device_type: str, compute: torch.dtype | None = None
) -> int:
    """What the smallest tile of a weight holds while it computes (``tile_held_bytes``)."""
    return tile_held_bytes(shape, itemsize, fewest_tile_rows(shape, itemsize), device_type, compute)


def tile_held_bytes(
    shape: Sequence[int], itemsize: int, rows: int, device_type: str, compute: torch.dtype | None = None
) -> int:
    """What a tile of ``rows`` rows of a weight of ``shape`` holds while it computes: ``times_held`` its
    bytes; where its projection converts it to ``compute``, its bytes, its converted copy and (on the
    CPU) that copy's in the whole-shaped buffer (``WeightRecord.footprint``)."""
    elements = rows * math.prod(shape[1:])
    if compute is None or len(shape) != 2:
        return times_held(device_type, shape) * elements * itemsize
    copies = 2 if copied_to_compute(device_type) else 1
    return elements * (itemsize + copies * compute.itemsize)


def tile_target(
    room: int, shape: Sequence[int], itemsize: int, device_type: str, compute: torch.dtype | None
) -> int:
    """The bytes of a weight's own rows a tile is sized to within ``room`` (``tile_share`` of it; less
    where its projection converts it, by what the converted copies add)."""
    target = room // tile_share(shape)
    plain = tile_held_bytes(shape, itemsize, 1, device_type)
    held = tile_held_bytes(shape, itemsize, 1, device_type, compute)
    return target if held <= plain else target * plain // held


def smallest_unit(record: WeightRecord, device_type: str) -> int:
    """The fewest bytes ``record`` can stream in: one tile of the fewest rows for a 2-D weight, one
    expert's slab for a 3-D one (held once: ``expert_tiles``), else the whole weight. Whether its uses
    allow tiles is known at capture."""
    if len(record.shape) == 3:
        return min(record.footprint, fewest_rows(record.shape, record.dtype.itemsize) * _slab(record))
    if len(record.shape) != 2:
        return record.footprint
    return min(record.footprint, smallest_tile_bytes(record.shape, record.dtype.itemsize, device_type))


def _slab(record: WeightRecord) -> int:
    """Bytes one row (one expert, for a stacked weight) of ``record`` takes as it streams."""
    return -(-record.footprint // record.shape[0])


def streaming_units(store: WeightStore, device_type: str) -> list[int]:
    """For each weight of ``store``, the fewest bytes it streams in on ``device_type``
    (``smallest_unit``)."""
    return [smallest_unit(r, device_type) for r in store.weights()]


def tile_ranges(rows: int, per_tile: int) -> list[tuple[int, int]]:
    """The row ranges of ``rows`` rows cut ``per_tile`` at a time (the last may be shorter)."""
    return [(start, min(start + per_tile, rows)) for start in range(0, rows, per_tile)]


def tile_oversized(
    gm: fx.GraphModule,
    facts: GraphFacts,
    store: WeightStore,
    memory: MemoryModel,
    device_type: str,
    expected: int = 0,
) -> tuple[fx.GraphModule, list[torch.nn.Parameter]]:
    """Split each weight of ``gm`` that cannot stream beside another piece to ``device_type`` into tiles
    of rows: the graph rewritten (a copy, or ``gm`` itself when nothing is split), and a ghost for each
    tile's new placeholder, in their order. ``expected``: activations later calls will hold, where more than
    this capture's (a generate's KV caches at its last token).

    Raises:
        BudgetTooSmallError: such a weight cannot fit even alone and a use of it cannot be tiled, or not
            even two of its smallest tiles fit beside the activations.
    """
    room = memory.room(max(facts.activation_bytes, expected))
    if room is None:
        return gm, []
    records = store.records
    sizes = sizes_for_budget(facts.weight_bytes, facts.names, facts.lookups, records, device_type)
    on_cpu = copied_to_compute(device_type)
    op = tile_op(device_type)
    # a weight held in RAM on a CPU run does not stream (and a tile is split already)
    streamed = [
        n
        for n, record in ((n, records[facts.names[n]]) for n in sizes)
        if (record.host is None if on_cpu else record.tier.streams) and record.tile_of is None
    ]
    tileable: list[fx.Node] = []
    whole: list[fx.Node] = []
    for node in [n for n in streamed if sizes[n] > too_large_for(room, device_type)]:
        shape = records[facts.names[node]].shape
        (tileable if can_tile(node, shape) else whole).append(node)
    # tiles hold one more output of their projection while they compute: the room is what is left
    activations = _activations_when_tiled(gm, facts, tileable, op) if tileable else facts.activation_bytes
    activations = max(activations, expected)
    room = memory.room(activations)
    assert room is not None
    todo, short = [], []  # short: (the budget it needs, why)
    for node in whole:
        record, blocker = records[facts.names[node]], blocking_use(node)
        if sizes[node] > room:
            use = f"its use by {describe(blocker)}" if blocker else f"a {len(record.shape)}-D weight"
            why = (
                f"{record.name} takes {format_bytes(sizes[node])} and must fit whole: {use} cannot be "
                "split into tiles (linear projections, of the weight or of it converted to another "
                "dtype, and embedding lookups can, by rows, and stacked experts used by grouped "
                "products, by experts)"
            )
            short.append((memory.smallest_budget(sizes[node], activations), why))
    for node in tileable:
        compute = compute_dtype(node)
        if compute is None and sizes[node] <= too_large_for(room, device_type):
            # chosen by the room beside the graph's activations untiled; with the others tiled, there is
            # room for it whole (a weight converted whole, as Ergo's head, counted its whole converted
            # copy; a converted weight is always tiled, since that room counts it tiled)
            continue
        record = records[facts.names[node]]
        shape, itemsize = record.shape, record.dtype.itemsize
        # two tiles in flight in the room, else tiles that stream alone (``tile_share``)
        target = tile_target(room, shape, itemsize, device_type, compute)
        per_tile = graph_tile_rows(shape, itemsize, target) or graph_tile_rows(shape, itemsize, 2 * target)
        if not per_tile and sizes[node] <= room and compute is None:
            continue  # its fewest rows (held twice) take more than it whole: it streams whole, alone
        todo.append((node, record, per_tile, compute))
        if not per_tile:
            unit = smallest_unit(record, device_type)
            copy = " with its copy" if on_cpu and len(shape) == 2 else ""
            if compute is not None:  # held with its converted copies (streamed whole, converted whole)
                unit = smallest_tile_bytes(shape, itemsize, device_type, compute)
                copy = f" with its copies in {str(compute).removeprefix('torch.')}"
            kind = "experts" if len(shape) == 3 else "rows"
            why = (
                f"not even {record.name} alone ({format_bytes(unit)}) fits"
                if unit >= record.footprint and compute is None
                else f"not even the smallest tile of {kind} of {record.name} ({format_bytes(unit)}{copy}, "
                f"a weight making at most {MOST_GRAPH_TILES} tiles) fits"
            ) + " beside what a piece holds whatever its weights"
            short.append((memory.smallest_budget(unit, activations), why))
    if short:
        smallest, why = max(short)
        raise memory.too_small(smallest, activations, why)
    if not todo:
        return gm, []
    gm, copies = own_copy(gm)
    ghosts, tiled = [], []
    for node, record, per_tile, compute in todo:
        made = split(gm, copies[node], tile_ranges(record.shape[0], per_tile), op)
        rows = "experts" if len(record.shape) == 3 else "rows"
        tiled.append(f"{record.name} ({len(made)} tiles of {per_tile} {rows})")
        for start, stop, _ in made:
            # a tile of experts computes alone, exactly: never copied into a whole-shaped buffer
            copied = on_cpu and len(record.shape) == 2
            tile = store.add_tile(record.name, start, stop, copied=copied, compute_dtype=compute)
            ghosts.append(ghost_for(store, tile, store.device))
    gm.recompile()
    report("too large to stream beside another piece, split into tiles: %s", ", ".join(tiled))
    return gm, ghosts


def _activations_when_tiled(gm: fx.GraphModule, facts: GraphFacts, weights: list[fx.Node], op: TileOp) -> int:
    """The activation peak of ``gm`` with ``weights`` split (into two tiles: more do not hold more)."""
    probe, copies = own_copy(gm)
    weight_nodes = {copies[n] for n in facts.weight_bytes}
    for weight in weights:
        rows = int(traced_value(weight).shape[0])
        made = split(probe, copies[weight], tile_ranges(rows, max(rows // 2, 1)), op)
        weight_nodes.update(tile for _start, _stop, tile in made)
    return activation_peak(probe.graph, weight_nodes)


def split(
    gm: fx.GraphModule, weight: fx.Node, ranges: Sequence[tuple[int, int]], op: TileOp
) -> list[tuple[int, int, fx.Node]]:
    """Split ``weight`` of ``gm`` into tiles of ``ranges``: a stacked expert weight by experts
    (``expert_tiles``), else by rows (``split_projections``). Each tile's (first, one past the last,
    placeholder). Only the graph is rewritten: recompile ``gm`` once every weight is split (its code,
    generated for the whole graph, took seconds a weight for a model of a few thousand ops)."""
    if len(traced_value(weight).shape) == 3:
        return expert_tiles.split_experts(gm, weight, ranges)
    return list(split_projections(gm, weight, ranges, op).tiles)


@dataclass(frozen=True)
class Tiling:
    """A weight placeholder of a graph, and the placeholder that stands for each of its tiles."""

    weight: fx.Node
    tiles: tuple[tuple[int, int, fx.Node], ...]  # (first row, one past the last, placeholder)


def own_copy(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of a graph dynamo handed to a backend, to rewrite (dynamo reads its own afterwards), and
    each of its nodes' copy."""
    graph = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    return fx.GraphModule(gm, graph), copies


def split_projections(
    gm: fx.GraphModule, weight: fx.Node, ranges: Sequence[tuple[int, int]], op: TileOp
) -> Tiling:
    """Rewrite every ``linear`` of ``weight`` in ``gm`` (or of its conversion to another dtype) as a chain
    of calls of ``op`` (``tile_linear`` or ``tile_linear_alone``), one per range of rows, each reading a
    new placeholder (appended after the graph's own, so the call's arguments keep their positions) and
    filling its columns of the first call's output; a conversion becomes each tile's own. Row lookups
    keep ``weight``."""
    graph = gm.graph
    rows = int(traced_value(weight).shape[0])
    tiles = tile_placeholders(graph, weight, ranges, "rows")
    for user, dtype in projections(weight):
        x = user.args[0]
        bias = user.args[2] if len(user.args) > 2 else user.kwargs.get("bias")
        filled: fx.Node | None = None
        with graph.inserting_before(user):
            for start, _stop, tile in tiles:
                converts = () if dtype is None else (dtype,)
                filled = graph.call_function(op, (x, tile, bias, start, rows, filled, *converts))
                filled.meta["example_value"] = traced_value(user)
        assert filled is not None, f"{weight.name}: no rows to tile"
        user.replace_all_uses_with(filled)
        graph.erase_node(user)
    for conversion in [u for u in weight.users if not u.users and conversion_of(u, weight) is not None]:
        graph.erase_node(conversion)  # its projections read the tiles now
    return Tiling(weight, tuple(tiles))


def extra_activation_bytes(weight: fx.Node) -> int:
    """What tiling ``weight`` adds to the activations: one more output of its largest projection while
    a tile computes beside the output being filled (of its grouped product, for stacked experts)."""
    if len(traced_value(weight).shape) == 3:
        return expert_tiles.extra_activation_bytes(weight)
    return max((value_bytes(traced_value(u)) for u, _ in projections(weight)), default=0)
