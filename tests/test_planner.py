"""Planning on synthetic records and graphs: no threads, no devices, no IO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx

from fxoffload_hf.loaders import InlineReader, ThreadedReader, Way
from fxoffload_hf.memory_model import BudgetTooSmallError, MemoryModel, pair_bytes, piece_bytes, window_bytes
from fxoffload_hf.planner import GraphInput, kept_bytes, partition_for_budget, plan_model
from fxoffload_hf.safetensors_io import TensorSlice
from fxoffload_hf.schedule import PieceProfile
from fxoffload_hf.weight_record import WeightRecord

THREADED, INLINE = ThreadedReader(), InlineReader()


def disk_record(name: str, numel: int, file_dtype=torch.float32, dtype=torch.float32) -> WeightRecord:
    size = numel * file_dtype.itemsize
    source = TensorSlice(Path("model.safetensors"), name, 4096, size, file_dtype, (numel,))
    return WeightRecord(name, (numel,), dtype, disk=source)


def host_record(name: str, numel: int) -> WeightRecord:
    return WeightRecord(name, (numel,), torch.float32, host=torch.zeros(numel))


def plan(
    records,
    pieces,
    *,
    device_type="cpu",
    budget=10**9,
    profile=(),
    lookups=frozenset(),
    policy="auto",
    held=None,
):
    by_name = {r.name: r for r in records}
    graph = GraphInput(tuple(tuple(p) for p in pieces), frozenset(lookups), tuple(profile))
    return plan_model(
        [graph],
        by_name,
        version=7,
        memory=MemoryModel(budget, fixed_bytes=100),
        activations=1000,
        device_type=device_type,
        policy=policy,
        threaded=THREADED,
        inline=INLINE,
        held=held,
    )


def test_weights_kept_are_counted_as_the_store_says_and_leave_the_rest_to_pieces_in_flight():
    kept = WeightRecord("k", (1000,), torch.float32, resident=torch.zeros(1000))
    streamed = [disk_record(f"w{i}", 1000) for i in range(4)]
    records = [kept, *streamed]
    assert kept_bytes({r.name: r for r in records}) == 4000
    pair = 2 * piece_bytes([4000])
    budget = 100 + 1000 + 4000 + pair  # fixed + activations + kept + two pieces in flight
    pieces = [[r.name] for r in streamed]
    assert not any(plan(records, pieces, budget=budget).graphs[0].ahead.cuts)
    # kept in place, it holds the 2 MiB unit of mapping around it (``WeightStore.held_bytes``): the
    # pieces no longer fit two at a time, and each streams alone
    units = plan(records, pieces, budget=budget, held=lambda rs: 4000 + pair // 2 * len(rs))
    assert all(units.graphs[0].ahead.cuts[1:])


def test_cpu_weights_in_place_are_mapped_and_need_no_arena():
    records = [disk_record(f"w{i}", 1000 + 100 * i) for i in range(5)]
    model = plan(records, [[r.name] for r in records], lookups={"w0"})
    # the lookup table w0 is read by rows from its mapped pages: it never counts whole in flight
    sizes = [0] + [piece_bytes([r.disk.nbytes]) for r in records[1:]]
    assert model.version == 7 and model.arena_bytes == 0
    assert model.in_flight_bytes == pair_bytes(sizes)
    (graph,) = model.graphs
    assert graph.ahead.distance == 1 and graph.ahead.reader is THREADED
    assert graph.ahead.group_ends == (1, 2, 3, 4, 5)
    for spec, record in zip(graph.ahead.loads, records, strict=True):
        assert spec.mapped == (record,) and not (spec.staged or spec.copied or spec.held)
        assert spec.fault_in == (record.name != "w0",)  # a lookup table reads its rows only
    inline = graph.inline
    assert inline is not None and inline.reader is INLINE and inline.distance == 0
    # loaded together while they fit in the room two pieces need (the table takes none of it)
    assert inline.group_ends == (3, 3, 3, 5, 5)
    assert [spec is not None for spec in inline.loads] == [True, False, False, True, False]
    assert {r.name for r in inline.loads[0].mapped} == {"w0", "w1", "w2"}


def test_weights_that_change_dtype_are_staged_two_loads_at_a_time():
    records = [disk_record(f"w{i}", 500, torch.float16, torch.float32) for i in range(4)]
    model = plan(records, [[r.name] for r in records])
    assert model.arena_bytes == pair_bytes([piece_bytes([1000])] * 4)
    (graph,) = model.graphs
    assert all(spec.staged and not spec.mapped for spec in graph.ahead.loads)
    assert [spec.side for spec in graph.ahead.loads] == [0, 1, 0, 1]
    assert graph.inline is not None and graph.inline.group_ends == (1, 2, 3, 4)  # never grouped


def test_cuda_copies_host_weights_and_stages_disk_weights_with_no_inline_schedule():
    records = [host_record("h0", 300), disk_record("d0", 300), host_record("h1", 300)]
    resident = WeightRecord("r", (10,), torch.float32, host=torch.zeros(10), resident=torch.zeros(10))
    model = plan([*records, resident], [["h0", "r"], ["d0"], ["h1"]], device_type="cuda")
    (graph,) = model.graphs
    assert graph.inline is None
    first, second, third = graph.ahead.loads
    assert [r.name for r in first.copied] == ["h0"] and [r.name for r in first.held] == ["r"]
    assert [r.name for r in second.staged] == ["d0"] and third.copied
    assert model.arena_bytes == piece_bytes([1200])
    assert first.streamed_bytes == 1200 and second.streamed_bytes == 1200
    assert graph.ahead.reader is THREADED  # a file is read: loads run on the read-ahead thread


def test_cuda_loads_that_read_no_file_are_queued_by_the_calling_thread():
    records = [host_record(f"h{i}", 300) for i in range(3)]
    model = plan(records, [[r.name] for r in records], device_type="cuda")
    (graph,) = model.graphs
    assert graph.ahead.reader is INLINE and graph.ahead.distance == 1 and graph.inline is None
    assert model.arena_bytes == 0 and all(spec.copied for spec in graph.ahead.loads)


def test_prefetch_distance_comes_from_the_profile_and_sets_what_is_in_flight():
    records = [disk_record(f"w{i}", 256) for i in range(4)]
    profile = [PieceProfile((r.name,), {r.name: 1024}, 0.5, 3.0) for r in records[:3]]
    profile.append(PieceProfile(("w3",), {"w3": 1024}, 5.0, 1.0))
    model = plan(records, [[r.name] for r in records], profile=profile)
    (graph,) = model.graphs
    sizes = [piece_bytes([1024])] * 4
    assert graph.ahead.distance >= 2
    assert model.in_flight_bytes == window_bytes(sizes, graph.ahead.distance + 1)
    sequential = plan(records, [[r.name] for r in records], profile=profile, policy="sequential")
    assert sequential.graphs[0].ahead.distance == 1


def test_plans_are_immutable():
    model = plan([disk_record("w", 10)], [["w"]])
    with pytest.raises(AttributeError):
        model.graphs[0].ahead.distance = 3  # type: ignore[misc]
    assert all(way in Way for way in (Way.MAPPED, Way.STAGED))


def _chain(weights: int) -> tuple[fx.Graph, dict[fx.Node, int]]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    sizes = {}
    for i in range(weights):
        w = graph.placeholder(f"w{i}")
        sizes[w] = 1000
        x = graph.call_function(torch.matmul, (x, w))
    graph.output(x)
    return graph, sizes


def test_partition_for_budget_refuses_with_the_one_error_and_the_smallest_budget():
    graph, sizes = _chain(6)
    memory = MemoryModel(2000, "cpu_memory", fixed_bytes=100)  # 900 B beside the activations: < 1000
    with pytest.raises(BudgetTooSmallError, match=r"cpu_memory=.*pass cpu_memory=\d+") as info:
        partition_for_budget(graph, sizes, 1000, memory, "auto")
    smallest = info.value.smallest_budget
    assert smallest == memory.smallest_budget(1000, 1000)
    fits = partition_for_budget(graph, sizes, 1000, MemoryModel(smallest, fixed_bytes=100), "auto")
    assert len(fits.pieces) == 6
    one = partition_for_budget(graph, sizes, 1000, MemoryModel(None), "auto")
    assert len(one.pieces) == 1
