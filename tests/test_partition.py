"""The resource partitioner on synthetic graphs: budgets, topological order, fusion groups, linear work."""

from __future__ import annotations

import operator

import pytest
import torch
from torch import fx

from fxoffload_hf.partition import BudgetTooSmallError, partition_graph


def chain_graph(layers: int, weight_size: int = 100) -> tuple[fx.Graph, dict[fx.Node, int]]:
    """x -> [linear(w_i, b_i) -> gelu -> add residual] * layers, weights as placeholders."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    weights: dict[fx.Node, int] = {}
    for i in range(layers):
        w = graph.placeholder(f"w{i}")
        b = graph.placeholder(f"b{i}")
        weights[w] = weight_size
        weights[b] = 1
        h = graph.call_function(torch.nn.functional.linear, (x, w, b))
        a = graph.call_function(torch.nn.functional.gelu, (h,))
        x = graph.call_function(operator.add, (a, x))
    graph.output(x)
    return graph, weights


def assert_topological(pieces) -> None:
    seen: set[fx.Node] = set()
    for piece in pieces:
        for node in piece.nodes:
            for dep in node.all_input_nodes:
                assert dep.op == "placeholder" or dep in seen, f"{node} runs before its input {dep}"
            seen.add(node)


def test_every_piece_fits_the_budget_and_all_nodes_are_placed():
    graph, weights = chain_graph(20)
    result = partition_graph(graph, weights, budget=350)
    assert len(result.pieces) >= 6
    for piece in result.pieces:
        assert piece.weight_bytes <= 350
        assert piece.weight_bytes == sum(weights[w] for w in piece.weights)
    compute = [n for n in graph.nodes if n.op == "call_function"]
    placed = [n for p in result.pieces for n in p.nodes]
    assert sorted(placed, key=compute.index) == compute and len(placed) == len(set(placed))


def test_pieces_are_in_topological_order():
    graph, weights = chain_graph(30)
    assert_topological(partition_graph(graph, weights, budget=250).pieces)


def test_projection_bias_and_activation_stay_together():
    graph, weights = chain_graph(12)
    piece_of = partition_graph(graph, weights, budget=101).piece_of()
    for node in graph.nodes:
        if node.target is torch.nn.functional.gelu:
            (linear,) = node.all_input_nodes
            assert piece_of[node] == piece_of[linear]


def test_getitem_stays_with_its_tuple_and_epilogue_is_reordered_next_to_its_producer():
    graph = fx.Graph()
    x = graph.placeholder("x")
    w1, w2 = graph.placeholder("w1"), graph.placeholder("w2")
    h1 = graph.call_function(torch.nn.functional.linear, (x, w1))
    h2 = graph.call_function(torch.nn.functional.linear, (x, w2))  # unrelated node between h1 and its act
    act = graph.call_function(torch.nn.functional.silu, (h1,))
    parts = graph.call_function(torch.split, (act, 2))
    first = graph.call_function(operator.getitem, (parts, 0))
    graph.call_function(operator.getitem, (parts, 1))
    graph.output((first, h2))
    piece_of = partition_graph(graph, {w1: 10, w2: 10}, budget=10).piece_of()
    assert piece_of[act] == piece_of[h1]
    assert piece_of[h2] != piece_of[h1]
    assert piece_of[parts] == piece_of[first]


def test_a_weight_view_travels_with_its_consumer():
    graph = fx.Graph()
    x = graph.placeholder("x")
    w1, w2 = graph.placeholder("w1"), graph.placeholder("w2")
    w2t = graph.call_method("t", (w2,))  # dynamo may emit this long before the matmul
    h = graph.call_function(torch.nn.functional.linear, (x, w1))
    y = graph.call_function(torch.matmul, (h, w2t))
    graph.output(y)
    piece_of = partition_graph(graph, {w1: 10, w2: 10}, budget=10).piece_of()
    assert piece_of[w2t] == piece_of[y] != piece_of[h]


def test_mutated_buffers_are_read_where_dynamo_put_the_read():
    graph = fx.Graph()
    x, cache, w = graph.placeholder("x"), graph.placeholder("cache"), graph.placeholder("w")
    snapshot = graph.call_method("clone", (cache,))
    graph.call_method("copy_", (cache, x))
    h = graph.call_function(torch.nn.functional.linear, (x, w))
    graph.output((h, snapshot))
    order = [n for p in partition_graph(graph, {w: 10}, budget=10).pieces for n in p.nodes]
    assert order.index(snapshot) < order.index(next(n for n in order if n.target == "copy_"))


def test_shared_weight_counts_in_each_piece_that_uses_it():
    graph = fx.Graph()
    ids = graph.placeholder("ids")
    emb = graph.placeholder("emb")
    w = graph.placeholder("w")
    h = graph.call_function(torch.nn.functional.embedding, (ids, emb))
    h = graph.call_function(torch.nn.functional.linear, (h, w))
    logits = graph.call_function(torch.nn.functional.linear, (h, emb))
    graph.output(logits)
    result = partition_graph(graph, {emb: 50, w: 50}, budget=60)
    assert [p.weight_bytes for p in result.pieces] == [50, 50, 50]


def test_weight_larger_than_budget_is_refused_with_the_smallest_budget():
    graph, weights = chain_graph(4)
    big = next(iter(weights))
    weights[big] = 1000
    with pytest.raises(BudgetTooSmallError, match=r"'w0'.*it needs") as info:
        partition_graph(graph, weights, budget=500)
    assert info.value.smallest_budget == 1001


def test_work_grows_linearly_with_graph_size():
    work = {}
    for layers in (1_000, 4_000, 16_000):
        graph, weights = chain_graph(layers)
        work[layers] = partition_graph(graph, weights, budget=1_000).work
    per_node = [work[n] / n for n in sorted(work)]
    # linear: the work per layer stays flat (a quadratic partitioner would grow it 16x)
    assert max(per_node) < 1.2 * min(per_node)


def test_device_constants_from_the_capture_device_are_retargeted():
    from fxoffload_hf.graphs import retarget_devices

    graph = fx.Graph()
    x = graph.placeholder("x")
    ones = graph.call_function(torch.ones, (3,), {"device": torch.device("cpu")})
    kept = graph.call_function(torch.zeros, (3,), {"device": "cuda:1"})
    graph.output((graph.call_function(operator.add, (x, ones)), kept))
    assert retarget_devices(graph, torch.device("cpu"), torch.device("cuda", 0)) == 1
    assert ones.kwargs["device"] == torch.device("cuda", 0)
    assert kept.kwargs["device"] == "cuda:1"


class StatefulBlocks(torch.nn.Module):
    """Weights inside a vmap, an autocast region and a grad-mode switch, and pointwise ops at their edges."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, a, b, c, d, e, f = self.layers
        x = first(x)  # so that pieces of two weights would cut every region in two
        x = torch.vmap(lambda row: b(a(row).relu()) * 2)(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = d(c(x).relu())
        x = x.float() + 1
        with torch.no_grad():
            x = f(e(x)).sigmoid()
        return x * 3


def _captured(module: torch.nn.Module, *args) -> fx.GraphModule:
    graphs: list[fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(module, backend=backend, fullgraph=True)(*args)
    (gm,) = graphs
    return gm


def test_no_piece_boundary_falls_inside_a_region_of_interpreter_state():
    gm = _captured(StatefulBlocks(), torch.randn(4, 32))
    weights = {n: 100 for n in gm.graph.nodes if n.op == "placeholder" and "weight" in n.name}
    pieces = partition_graph(gm.graph, weights, budget=200).pieces
    assert len(pieces) == 4
    steps = {"_vmap_increment_nesting": 1, "_vmap_decrement_nesting": -1, "_enter_autocast": 1}
    steps |= {"_exit_autocast": -1}
    placed = [n for p in pieces for n in p.nodes]
    assert_topological(pieces)
    grad_switches = 0
    for piece in pieces:
        depth = 0
        for node in piece.nodes:
            name = getattr(node.target, "__name__", "")
            depth += steps.get(name, 0)
            grad_switches += name == "_set_grad_enabled"
            assert depth >= 0, f"{node} leaves a region it did not enter in the same piece"
        assert depth == 0 and grad_switches % 2 == 0, f"piece {piece.index} ends inside a region"
    # state changes keep dynamo's order, and nothing crosses one
    order = [n for n in gm.graph.nodes if n in set(placed)]
    markers = [n for n in order if getattr(n.target, "__name__", "") in (*steps, "_set_grad_enabled")]
    assert [n for n in placed if n in markers] == markers


def test_a_model_with_stateful_regions_runs_exactly_when_offloaded_in_small_pieces(weight_bytes):
    import fxoffload_hf

    torch.manual_seed(0)
    model, x = StatefulBlocks(width=256).eval(), torch.randn(4, 256)
    expected = model(x)
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.7), device="cpu")
    try:
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
        assert max(r.program.pieces for r in fxoffload_hf.engine_of(model).runners) >= 3
    finally:
        fxoffload_hf.restore(model)
