"""What a captured graph tells before it runs: its weights, their sizes, its activation peak, its lookups.

Pure functions of an ``fx.Graph`` and its example inputs (no IO, no engine): the planner reads the
``GraphFacts`` they produce, and the program builder cuts the same graph into pieces.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxoffload_hf.capture import handle_of
from fxoffload_hf.kv_disk import paged_out_bytes
from fxoffload_hf.memory_model import nbytes
from fxoffload_hf.row_lookups import LOOKUPS
from fxoffload_hf.weight_rescaling import weight_write_error


@dataclass(frozen=True)
class GraphFacts:
    """The weights of one captured graph and what it holds while it runs."""

    names: dict[fx.Node, str]  # weight placeholder -> stored weight name
    positions: dict[fx.Node, int]  # weight placeholder -> argument position
    weight_bytes: dict[fx.Node, int]  # weight placeholder -> bytes in flight when it streams
    activation_bytes: int
    lookups: frozenset[str]  # weights used only as tables of row lookups


def graph_facts(gm: fx.GraphModule, example_inputs: list[Any]) -> GraphFacts:
    """Find the weights among ``gm``'s placeholders from their ghosts, and measure the graph; raise where it
    writes into a weight (``refuse_weight_writes``)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names: dict[fx.Node, str] = {}
    positions: dict[fx.Node, int] = {}
    weight_bytes: dict[fx.Node, int] = {}
    for index, (node, value) in enumerate(zip(placeholders, example_inputs, strict=False)):
        handle = handle_of(value)
        if handle is not None:
            names[node] = handle.record.name
            positions[node] = index
            weight_bytes[node] = handle.record.footprint
    refuse_weight_writes(gm.graph, names)
    at = {node: i for i, node in enumerate(placeholders)}
    own = [
        example_inputs[at[n]] for n in call_inputs(gm.graph, set(weight_bytes)) if at[n] < len(example_inputs)
    ]
    return GraphFacts(
        names=names,
        positions=positions,
        weight_bytes=weight_bytes,
        # a KV cache kept on disk (``kv_disk``) is held a few layers at a time, not whole
        activation_bytes=activation_peak(gm.graph, set(weight_bytes)) - paged_out_bytes(own),
        lookups=frozenset(names[w] for w in weight_bytes if only_row_lookups(w)),
    )


# dynamo names a placeholder after where it came from: a module's buffers and parameters (counted with
# the model's small tensors, or streamed) say so; the rest are what the call passed (ids, masks, the KV
# cache), held by the caller for the whole call
_MODULE_STATE = ("_buffers_", "_parameters_")


def traced_value(node: fx.Node) -> Any:
    """The fake value dynamo traced for ``node`` (sizes symbolic where they are)."""
    return node.meta.get("example_value", node.meta.get("val"))


def is_method_of(node: fx.Node, source: fx.Node, methods: frozenset[str]) -> bool:
    """Whether ``node`` calls one of tensor ``methods`` on ``source`` (``source.float()``)."""
    return node.op == "call_method" and node.target in methods and bool(node.args) and node.args[0] is source


def tile_placeholders(
    graph: fx.Graph, weight: fx.Node, ranges: Sequence[tuple[int, int]], what: str
) -> list[tuple[int, int, fx.Node]]:
    """A placeholder for each range of ``weight``'s first dimension (its rows, or experts), appended
    after the graph's own so the call's arguments keep their positions, traced as that slice; each
    range's (first, one past the last, placeholder). ``what`` names them (``rows``, ``experts``)."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    value = traced_value(weight)
    tiles = []
    for start, stop in ranges:
        with graph.inserting_after(last):
            last = graph.placeholder(f"{weight.name}_{what}_{start}_{stop}")
        with value.fake_mode:
            last.meta["example_value"] = value[start:stop]
        tiles.append((start, stop, last))
    return tiles


def call_inputs(graph: fx.Graph, weight_nodes: set[fx.Node]) -> list[fx.Node]:
    """The placeholders of ``graph`` that are tensors the call passed, not the model's own."""
    return [
        node
        for node in graph.nodes
        if node.op == "placeholder"
        and node not in weight_nodes
        and isinstance(traced_value(node), torch.Tensor)
        and not any(mark in node.name for mark in _MODULE_STATE)
    ]


def activation_peak(graph: fx.Graph, weight_nodes: set[fx.Node]) -> int:
    """Peak bytes held while ``graph`` runs in order (from fake example values): the tensors the call
    passed (a KV cache among them) and the live intermediates, each storage counted once."""
    held = sum(value_bytes(traced_value(n)) for n in call_inputs(graph, weight_nodes))
    live, peak = held, held
    sizes: dict[fx.Node, int] = {}
    for step in storage_walk(graph, weight_nodes):
        if step.new:
            sizes[step.node] = sum(value_bytes(t) for t in step.new)
            live += sizes[step.node]
            peak = max(peak, live)
        for value in step.frees:
            live -= sizes.pop(value, 0)
    return peak


STORAGE_KEYS = "fxoffload_storage_keys"  # node.meta: storage keys that stand for the traced value's


@dataclass(frozen=True)
class WalkStep:
    """One node of a graph run in order: the tensors of its value that are new storage, and the nodes
    whose storage is dead once it ran."""

    node: fx.Node
    new: list[torch.Tensor]
    frees: list[fx.Node]


def storage_walk(graph: fx.Graph, weight_nodes: set[fx.Node]) -> list[WalkStep]:
    """The nodes of ``graph`` that compute (not placeholders, weights or the output), each with the
    tensors it allocates. A tensor whose storage is that of a tensor of one of the node's arguments (a
    view, an in-place result: a slice of a KV cache written in place, a tuple's item, a transposed
    weight) adds nothing and keeps the value that allocated it alive. Only arguments count: graph
    rewrites (dynamo's inlined regions, ``plan_depth``'s copies) can give unrelated nodes one fake value.
    A storage is dead after the last use of every node that holds it; a value never used (but a view's)
    stays alive to the end."""
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    # per node, its tensors' storages -> the node that allocated each (None: an input's)
    owners: dict[fx.Node, dict[Any, fx.Node | None]] = {}
    new: dict[fx.Node, list[torch.Tensor]] = {}
    holds: dict[fx.Node, set[fx.Node]] = {}  # node -> earlier nodes whose storage it shares
    for node in nodes:
        if node.op in ("placeholder", "get_attr") or node in weight_nodes:
            owners[node] = {key: None for key in storage_keys(node) if key is not None}
            continue
        if node.op == "output":
            continue
        viewed: dict[Any, fx.Node | None] = {}
        for argument in node._input_nodes:
            viewed.update(owners.get(argument, {}))
        new[node], owners[node] = [], {}
        for tensor, key in zip(_tensors(traced_value(node)), storage_keys(node), strict=True):
            if key is not None and key in viewed:
                owners[node][key] = viewed[key]
                if viewed[key] is not None:
                    holds.setdefault(node, set()).add(viewed[key])  # type: ignore[arg-type]
            else:
                new[node].append(tensor)
                if key is not None:
                    owners[node][key] = node
    last = {value: user for user, values in last_uses(graph).items() for value in values}
    death: dict[fx.Node, fx.Node | None] = {node: last.get(node) for node, made in new.items() if made}
    for node, allocators in holds.items():
        for held in allocators:
            end = death.get(held)
            if end is not None:  # a view never used (an in-place op's result) ends where it runs
                death[held] = max(end, last.get(node, node), key=order.__getitem__)
    frees: dict[fx.Node, list[fx.Node]] = {}
    for node, end in death.items():
        if end is not None:
            frees.setdefault(end, []).append(node)
    return [WalkStep(node, made, frees.get(node, [])) for node, made in new.items()] + [
        WalkStep(node, [], frees[node]) for node in nodes if node not in new and node in frees
    ]


def last_uses(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the values whose last use it is (they can be freed once it ran)."""
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for dep in node._input_nodes:
            last_use[dep] = node
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        frees.setdefault(user, []).append(value)
    return frees


def storage_keys(node: fx.Node) -> list[Any]:
    """A key of the storage of each tensor in ``node``'s traced value (None where it has none): the
    storages themselves, or the keys a graph rewrite gave copies of nodes (``STORAGE_KEYS``, as
    ``plan_depth`` does: a copy's values are the original's fake tensors, their storages its own)."""
    if STORAGE_KEYS in node.meta:
        return list(node.meta[STORAGE_KEYS])
    return [_storage(t) for t in _tensors(traced_value(node))]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage(tensor: torch.Tensor) -> Any:
    """A key of the storage ``tensor`` views (fake tensors have storages too); None if it has none."""
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


def value_bytes(value: Any) -> int:
    """Bytes of a (fake) example value: tensors at their size hints, nested in lists and tuples."""
    if isinstance(value, torch.Tensor):
        return nbytes((_hint(d) for d in value.shape), value.element_size())
    if isinstance(value, list | tuple):
        return sum(value_bytes(v) for v in value)
    return 0


def _hint(dim: Any) -> int:
    if isinstance(dim, int):
        return dim
    node = getattr(dim, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else 1


# Python's in-place operators, as dynamo records ``w /= 2`` (a method ending in ``_`` records ``w.div_(2)``)
_IN_PLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.setitem,
})  # fmt: skip
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_"})  # end in ``_`` but leave the values
# a dunder method ends in ``_`` too; of those only the in-place operators' (``__iadd__``, ``__setitem__``) write
_WRITING_DUNDERS = frozenset(f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS)


def refuse_weight_writes(graph: fx.Graph, names: dict[fx.Node, str]) -> None:
    """Raise where the graph writes into a weight in place (``w.div_(2)``, ``w /= 2``, ``w.copy_(x)``): an
    offloaded weight is read afresh at each use, so the write would be lost and the output differ from
    eager's. Models known to do so are changed not to first (``weight_rescaling``)."""
    for weight, name in names.items():
        for user in weight.users:
            if not user.args or user.args[0] is not weight:
                continue
            target = user.target
            label = target if isinstance(target, str) else getattr(target, "__name__", str(target))
            writes = (user.op == "call_method" and isinstance(target, str) and _method_writes(label)) or (
                user.op == "call_function"
                and (target in _IN_PLACE_OPERATORS or (not label.startswith("_") and _method_writes(label)))
            )
            if writes:
                raise weight_write_error(name, f"`{label}`")


def _method_writes(name: str) -> bool:
    """Whether the tensor method ``name`` writes into its tensor: ``div_``, ``__iadd__``, not ``__getitem__``."""
    if name.startswith("__") and name.endswith("__"):
        return name in _WRITING_DUNDERS
    return name.endswith("_") and name not in _NOT_WRITES


def only_row_lookups(weight: fx.Node) -> bool:
    """Whether the graph uses ``weight`` only as the table of embedding lookups (it reads some rows)."""
    users = list(weight.users)
    return bool(users) and all(is_row_lookup(user, weight) for user in users)


def is_row_lookup(user: fx.Node, weight: fx.Node) -> bool:
    """Whether ``user`` is an embedding lookup with ``weight`` as its table."""
    return (
        user.op == "call_function"
        and user.target in LOOKUPS
        and len(user.args) > LOOKUPS[user.target]
        and user.args[LOOKUPS[user.target]] is weight
    )


def capture_device(example_inputs: list[Any]) -> torch.device | None:
    """The device the graph was traced on: that of its first tensor input."""
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def retarget_devices(graph: fx.Graph, source: torch.device, target: torch.device) -> int:
    """Rewrite device constants baked into ``graph`` (``device=`` arguments) from ``source`` to ``target``.

    Returns how many arguments changed. Only ``source`` is rewritten: a constant naming another device
    (say, a deliberate CPU tensor in a GPU graph) stays as it is.
    """

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device | str) and value != "meta":
            try:
                if torch.device(value) == source:
                    return target
            except RuntimeError:
                return value
        return value

    changed = 0
    for node in graph.nodes:
        if "device" in node.kwargs:
            new = swap(node.kwargs["device"])
            if new is not node.kwargs["device"]:
                node.kwargs = {**node.kwargs, "device": new}
                changed += 1
    return changed
