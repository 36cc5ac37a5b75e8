"""What a captured graph is made into before it is cut into pieces: conversions of a weight to its own
dtype dropped (``noop_conversions``), on CUDA its lookups gathered on the host (``row_lookups``), and
weights too large to stream beside another piece split into tiles of rows (``tiles``). Each rewrite
works on a copy of the graph (dynamo keeps the one it gave), and the graph's facts are read again after
it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from fxoffload_hf import row_lookups, tiles
from fxoffload_hf.graphs import GraphFacts, graph_facts
from fxoffload_hf.memory_model import MemoryModel
from fxoffload_hf.noop_conversions import drop_noop_conversions, has_noop_conversions
from fxoffload_hf.weights import WeightStore


def prepare_graph(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    facts: GraphFacts,
    *,
    store: WeightStore,
    memory: MemoryModel,
    device_type: str,
    expected_activations: int,
    make_room: Callable[[int], None],
) -> tuple[fx.GraphModule, list[Any], GraphFacts]:
    """The graph rewritten for streaming, its example inputs (with the tiles' ghosts) and its facts.
    ``make_room(activation_bytes)`` is asked before weights are tiled for the room the graph's
    activations (or a generate's ``expected_activations``) leave, and again for the tiled graph's."""
    if has_noop_conversions(list(facts.weight_bytes)):
        gm, copies = tiles.own_copy(gm)
        drop_noop_conversions(gm.graph, [copies[w] for w in facts.weight_bytes])
        gm.recompile()
        facts = graph_facts(gm, example_inputs)
    if device_type == "cuda" and facts.lookups:
        gm, copies = tiles.own_copy(gm)
        tables = {copies[w] for w in facts.weight_bytes if facts.names[w] in facts.lookups}
        row_lookups.gather_on_host(gm, tables)
        facts = graph_facts(gm, example_inputs)
    make_room(max(facts.activation_bytes, expected_activations))
    gm, tile_ghosts = tiles.tile_oversized(gm, facts, store, memory, device_type, expected_activations)
    if tile_ghosts:
        example_inputs = [*example_inputs, *tile_ghosts]
        facts = graph_facts(gm, example_inputs)
        make_room(facts.activation_bytes)
    return gm, example_inputs, facts
