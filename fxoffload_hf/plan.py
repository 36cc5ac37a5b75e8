"""The plan of a model without running it: capture on the meta device, partition, report.

Shapes propagate through meta tensors, so nothing is allocated and no real compute runs. The report
gives the smallest budget of the captured, streamed schedule and that of eager calls (``plan_eager``:
the default, ``capture="deferred"``, runs a short answer that way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import fx

from fxoffload_hf import plan_capture, tiles
from fxoffload_hf.config import RESIDENT_THRESHOLD, BudgetSpec, counts_graph_state, parse_budgets
from fxoffload_hf.graphs import activation_peak, call_inputs, only_row_lookups, traced_value
from fxoffload_hf.kv_cache import kv_cache_bytes
from fxoffload_hf.memory import free_device_memory, free_host_memory
from fxoffload_hf.memory_model import (
    BudgetTooSmallError,
    MemoryModel,
    cuts_for,
    format_bytes,
    graph_state_bytes,
    nbytes,
    piece_bytes,
    window_bytes,
)
from fxoffload_hf.noop_conversions import drop_noop_conversions
from fxoffload_hf.plan_eager import eager_floor
from fxoffload_hf.plan_report import PlanReport
from fxoffload_hf.planner import partition_for_budget
from fxoffload_hf.projections import compute_dtype, conversion_of
from fxoffload_hf.reserved_cache import full_attention_only
from fxoffload_hf.tradeoff import Bandwidths, budgets_between, estimate


def plan_checkpoint(
    folder: str | Path,
    *,
    gpu_memory: BudgetSpec = None,
    cpu_memory: BudgetSpec = None,
    device: str | None = "cpu",
    batch: int = 1,
    seq_len: int = 128,
    bandwidths: Bandwidths | None = None,
) -> PlanReport:
    """Plan the model of a checkpoint folder (only its config.json is read)."""
    import transformers as tf

    from fxoffload_hf.integrations.transformers import resolve_checkpoint_folder

    config = tf.AutoConfig.from_pretrained(resolve_checkpoint_folder(folder))
    return plan_config(
        config,
        gpu_memory=gpu_memory,
        cpu_memory=cpu_memory,
        device=device,
        batch=batch,
        seq_len=seq_len,
        bandwidths=bandwidths,
    )


def plan_config(
    config: Any,
    *,
    gpu_memory: BudgetSpec = None,
    cpu_memory: BudgetSpec = None,
    device: str | None = "cpu",
    batch: int = 1,
    seq_len: int = 128,
    bandwidths: Bandwidths | None = None,
) -> PlanReport:
    """Plan a transformers config built on the meta device, for a forward of ``batch`` x ``seq_len``.

    ``device="cuda"`` plans for a GPU even on a machine without one (budgets must then be sizes, not
    shares of free memory). On the CPU, an embedding table read by rows from its file does not count whole.
    """
    import transformers as tf

    device_type = _device_type(device)
    gpu_budget, cpu_budget = _budgets(device_type, gpu_memory, cpu_memory)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    capture, names = plan_capture.shallow(config, model, ids) or plan_capture.deep(model, ids)
    gm, example_inputs = capture.graph, capture.example_inputs
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights: dict[fx.Node, int] = {}
    labels: dict[fx.Node, str] = {}
    passed = set(call_inputs(gm.graph, set()))  # the ids: counted with the activations
    for node, value in zip(placeholders, example_inputs, strict=False):
        if not isinstance(value, torch.Tensor) or node in passed:
            continue
        size = nbytes(value.shape, value.element_size())
        if isinstance(value, torch.nn.Parameter) and size >= RESIDENT_THRESHOLD:
            weights[node] = size
            labels[node] = names.get(id(value), node.name)
    drop_noop_conversions(gm.graph, list(weights))  # as the engine does: they would block tiles
    small = _small_tensors(model)
    forward = activation_peak(gm.graph, set(weights))
    kv = kv_cache_bytes(config, batch, seq_len, _dtype_bytes(model))

    def with_kv(forward: int) -> int:
        # generate: the prefill builds the cache beside its activations; a decode step at the last length
        # holds the cache it was passed and, unless it is written in place (``reserved_cache``: full
        # attention only), the one it builds
        return forward + kv if full_attention_only(config) else max(forward + kv, 2 * kv)

    activations = with_kv(forward)
    # a table used only for lookups is read by rows where it lies (``row_lookups`` on CUDA), and a weight
    # that only projections and lookups use streams in tiles of rows if it must (``tiles``)
    sizes = {w: 0 if only_row_lookups(w) else b for w, b in weights.items()}
    shapes = {w: tuple(v.shape) for w, v in zip(placeholders, example_inputs, strict=False) if w in weights}
    # each weight's own: a model may keep a few in fp32 beside bf16 ones (Ergo's gates and router)
    itemsizes = {
        w: v.element_size() for w, v in zip(placeholders, example_inputs, strict=False) if w in weights
    }
    tileable = {w for w in sizes if sizes[w] and tiles.can_tile(w, shapes[w])}
    # at the floor those stream in tiles, each converting its own rows where the model converts the
    # weight (counted in the tile): the whole converted weight is not an activation there
    converted = {c for w in tileable for c in w.users if conversion_of(c, w) is not None}
    tiled_forward = activation_peak(gm.graph, set(weights) | converted) if converted else forward
    floor_activations = with_kv(tiled_forward)
    memory = MemoryModel.where_it_computes(device_type, gpu_budget, cpu_budget, small)
    eager = eager_floor(model, ids, memory.fixed_bytes, device_type)
    # generate captures two graphs (prefill, decode), each about this one's size; the floor holds the
    # second's capture transient too (``MemoryModel.with_graph``), the steady state does not
    if device_type == "cpu" and counts_graph_state():
        memory = memory.with_graph(len(gm.graph.nodes)).with_graph(len(gm.graph.nodes))
    # on a GPU their state lies in host RAM, charged to cpu_memory (``host_room``): fewer weights stay there
    host_graphs = 0
    if device_type == "cuda" and cpu_budget is not None and counts_graph_state():
        host_graphs = 2 * graph_state_bytes(len(gm.graph.nodes))
    host_budget = None if device_type != "cuda" or cpu_budget is None else max(cpu_budget - host_graphs, 0)
    computes = {w: compute_dtype(w) for w in tileable}  # read once: each walks the weight's users
    converting = {w for w, compute in computes.items() if compute is not None}

    def floor_of(w: fx.Node) -> tuple[int, int]:
        """The smallest budget ``w`` allows, and the activations beside it there."""

        def beside(acts: int) -> int:
            if w in tileable:
                unit = tiles.smallest_tile_bytes(shapes[w], itemsizes[w], device_type, computes[w])
                return memory.smallest_budget(unit, acts + tiles.extra_activation_bytes(w))
            return memory.smallest_budget(sizes[w], acts)

        floor = beside(floor_activations)
        # the engine tiles a converted weight only where it is too large beside the untiled activations;
        # where it is not at this budget it streams whole, its converted copy an activation
        room_untiled = floor - memory.need(activations=activations)
        if any(sizes[c] <= tiles.too_large_for(room_untiled, device_type) for c in converting):
            return beside(activations), activations
        return floor, floor_activations

    floors = {w: floor_of(w) for w in sizes}
    heaviest = max(floors, key=lambda w: floors[w][0], default=None)
    report = PlanReport(
        model=type(model).__name__,
        weight_bytes=sum(weights.values()),
        resident_small_bytes=small,
        activation_bytes=forward,
        tiled_activation_bytes=tiled_forward,
        kv_cache_bytes=kv,
        budget_name=memory.budget_name,
        budget=memory.budget,
        pieces=[],
        arena_bytes=0,
        resident_bytes_max=0,
        smallest_budget=floors[heaviest][0] if heaviest else memory.smallest_budget(0, activations),
        floor_set_by=_floor_reason(
            heaviest,
            heaviest in tileable,
            sizes,
            labels,
            floors[heaviest][1] if heaviest else activations,
            memory,
        ),
        device=device_type,
        blocks_traced=capture.blocks_traced,
        blocks_reused=capture.blocks_reused,
        graph_state_bytes=memory.graph_bytes or host_graphs,
        eager_budget=eager.budget,
        eager_set_by=eager.set_by,
    )
    memory = memory.with_capture_reserve(0)
    held = memory.need()  # small tensors and the graphs' state, beside the activations
    full = report.weight_bytes + held + activations
    largest = max(sizes.values(), default=0)
    report.tradeoff = [
        estimate(
            b,
            weights=report.weight_bytes,
            fixed=held,
            activations=activations,
            in_flight=min(2 * largest, report.weight_bytes, max(b - held - activations, 0)),
            device_type=device_type,
            host_budget=host_budget,
            bandwidths=bandwidths or Bandwidths(),
        )
        for b in budgets_between(report.smallest_budget, full)
    ]
    room, tiled_room = memory.room(activations), memory.room(floor_activations)
    rooms = None if room is None or tiled_room is None else (room, tiled_room)
    if rooms and _tile_for_room(gm, sizes, labels, computes, rooms, shapes, itemsizes, device_type):
        # as the engine measures the graph it rewrote: tiles' products, no whole converted weight
        activations = with_kv(activation_peak(gm.graph, set(sizes)))
        room = memory.room(activations)
    try:
        partition = partition_for_budget(gm.graph, sizes, activations, memory, "auto", labels)
    except BudgetTooSmallError as exc:
        report.error = str(exc)
        report.smallest_budget = max(exc.smallest_budget, report.smallest_budget)
        return report
    report.pieces = [p.weight_bytes for p in partition.pieces]
    piece_sizes = [piece_bytes(sizes[w] for w in p.weights) for p in partition.pieces]
    # a piece too large to pair with its neighbour streams alone
    report.arena_bytes = window_bytes(piece_sizes, 2, cuts_for(piece_sizes, room))
    report.resident_bytes_max = report.weight_bytes if room is None else max(room - report.arena_bytes, 0)
    return report


def _tile_for_room(
    gm: fx.GraphModule,
    sizes: dict[fx.Node, int],
    labels: dict[fx.Node, str],
    computes: dict[fx.Node, torch.dtype | None],
    rooms: tuple[int, int],
    shapes: dict[fx.Node, tuple[int, ...]],
    itemsizes: dict[fx.Node, int],
    device_type: str,
) -> bool:
    """Split the weights the engine would split into tiles (as ``tiles.tile_oversized`` does: those too
    large beside the untiled activations, ``rooms[0]``, sized beside the tiled ones, ``rooms[1]``), adding
    their tiles' sizes and names; whether any was split. ``computes``: the weights tiles can serve, each
    with the dtype its projections convert it to (``projections.compute_dtype``)."""
    untiled, room = rooms
    oversized = [w for w in computes if sizes[w] > tiles.too_large_for(untiled, device_type)]
    room -= max(map(tiles.extra_activation_bytes, oversized), default=0)
    # one not converted that fits whole once the others are tiled streams whole
    oversized = [
        w for w in oversized if computes[w] is not None or sizes[w] > tiles.too_large_for(room, device_type)
    ]
    split = False
    for weight in oversized:
        shape, itemsize, compute = shapes[weight], itemsizes[weight], computes[weight]
        per_tile = tiles.graph_tile_rows(
            shape, itemsize, tiles.tile_target(room, shape, itemsize, device_type, compute)
        )
        if not per_tile:
            continue  # the partition refuses it by name
        ranges = tiles.tile_ranges(shape[0], per_tile)
        made = tiles.split(gm, weight, ranges, tiles.tile_op(device_type))
        for start, stop, node in made:
            sizes[node] = tiles.tile_held_bytes(shape, itemsize, stop - start, device_type, compute)
            labels[node] = f"{labels[weight]}[{start}:{stop}]"
        sizes[weight] = 0 if only_row_lookups(weight) else sizes[weight]
        split = True
    if split:
        gm.recompile()
    return split


def _small_tensors(model: torch.nn.Module) -> int:
    """Bytes ``offload`` keeps on the compute device for good: the parameters below the streaming
    threshold and every buffer (``api``), whether the graph uses them or not."""
    params = {id(p): p for p in model.parameters()}.values()
    small = sum(n for n in (nbytes(p.shape, p.element_size()) for p in params) if n < RESIDENT_THRESHOLD)
    buffers = (b for m in model.modules() for b in m._buffers.values() if b is not None)
    return small + sum(nbytes(b.shape, b.element_size()) for b in buffers)


def _dtype_bytes(model: torch.nn.Module) -> int:
    """The element size of the dtype most of ``model``'s parameters are in (its cache's): a few may be
    kept in fp32 beside bf16 ones, and the first parameter may be one of them."""
    elements: dict[int, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            elements[p.element_size()] = elements.get(p.element_size(), 0) + p.numel()
    return max(elements, key=lambda size: elements[size], default=4)


def _device_type(device: str | None) -> str:
    try:
        kind = torch.device(device or "cpu").type
    except (RuntimeError, TypeError):
        raise ValueError(f"device: cannot read {device!r}; plan for 'cpu' or 'cuda'") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device: {kind!r} is not supported; plan for 'cpu' or 'cuda'")
    return kind


def _budgets(
    device_type: str, gpu_memory: BudgetSpec, cpu_memory: BudgetSpec
) -> tuple[int | None, int | None]:
    """The budgets in bytes; a GPU this machine does not have has no free memory to take a share of."""
    gpu_free = None
    if device_type == "cuda" and torch.cuda.is_available():
        gpu_free = free_device_memory(torch.device("cuda", torch.cuda.current_device()))
    elif device_type == "cpu":
        gpu_free = free_host_memory()
    return parse_budgets(device_type, gpu_memory, cpu_memory, gpu_free)


def _floor_reason(
    heaviest: fx.Node | None,
    tiled: bool,
    sizes: dict[fx.Node, int],
    labels: dict[fx.Node, str],
    activations: int,
    memory: MemoryModel,
) -> str:
    """What sets the smallest budget: the largest weight streamed alone (or its smallest tiles), the
    activations, captured graphs' state, small tensors."""
    if heaviest is None:
        what = "no weights"
    elif tiled:
        kind = "experts" if len(traced_value(heaviest).shape) == 3 else "rows"
        what = (
            f"{labels[heaviest]} ({format_bytes(sizes[heaviest])}) streamed in its smallest tiles of {kind}"
        )
    else:
        what = f"{labels[heaviest]} ({format_bytes(sizes[heaviest])}) streamed alone"
    graphs = f" + {format_bytes(memory.graph_bytes)} of captured graphs" if memory.graph_bytes else ""
    between = f"{format_bytes(activations)} of activations and KV cache"
    if memory.capture_reserve > activations:
        between = f"{format_bytes(memory.capture_reserve)} kept while a graph is captured (more than the activations)"
    return f"{what} + {between}{graphs} + {format_bytes(memory.fixed_bytes)} of small tensors"
