"""A deep model planned from a capture of two of its layers: what ``plan`` costs does not grow with depth.

Dynamo traces a repeated block once and stamps out the rest (``blocks``), but each stamp still costs it
a reuse check (about 0.1 s a layer here: most of a 70B plan). Where every decoder layer is alike (one
class, one parameter layout, the same flags: ``blocks.all_alike``), ``plan`` builds
the same model with two layers, captures that, and copies the second layer's nodes once per missing
layer in the fx graph (``deepen``), with a weight placeholder of its own for each copy's weights, named
as the deep model names them. The plan partitions that graph as it would the deep model's. Anything
unexpected (layers not all alike, a config that cannot shrink, layers whose captured nodes differ) gives
None, and ``plan`` captures the deep model itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxoffload_hf.blocks import all_alike
from fxoffload_hf.graphs import STORAGE_KEYS, storage_keys
from fxoffload_hf.kv_cache import text_config

TRACED_LAYERS = 2  # the first, and one whose nodes are copied (its inputs come from a layer before it)


@dataclass(frozen=True)
class Layers:
    """The decoder layers of a model: the path of their list and how many there are."""

    path: str
    depth: int


def alike_layers(model: nn.Module) -> Layers | None:
    """The one list of blocks all alike that holds more layers than are traced, or None."""
    found = [
        Layers(name, len(module))
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > TRACED_LAYERS + 1 and all_alike(module)
    ]
    return found[0] if len(found) == 1 else None


def shallow_config(config: Any, layers: int) -> Any | None:
    """A copy of ``config`` whose decoder has ``layers`` layers (per-layer lists cut alike), or None."""
    shallow = copy.deepcopy(config)
    text = text_config(shallow)
    if not isinstance(getattr(text, "num_hidden_layers", None), int):
        return None
    try:
        text.num_hidden_layers = layers
        kinds = getattr(text, "layer_types", None)
        if isinstance(kinds, list):
            text.layer_types = kinds[:layers]
    except (AttributeError, TypeError, ValueError):  # derived, read-only or validated attributes
        return None
    return shallow


def deepen(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    names: dict[int, str],
    layers: Layers,
) -> list[Any] | None:
    """Copy the last traced layer's nodes of ``gm`` (captured with ``TRACED_LAYERS`` layers) until it has
    ``layers.depth``, in place; the example inputs with a meta tensor for each new placeholder of a
    layer's weights and buffers, in the graph's order (``names``, of parameters and buffers, learns
    theirs). None, with ``gm`` untouched, where the traced layers' nodes do not match one for one."""
    graph = gm.graph
    first, last = (_layer_nodes(graph, f"{layers.path}.{k}") for k in (0, TRACED_LAYERS - 1))
    if (
        not last
        or len(first) != len(last)
        or any(a.target != b.target for a, b in zip(first, last, strict=True))
    ):
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    value_of = dict(zip(placeholders, example_inputs, strict=False))
    prefix = f"{layers.path}.{TRACED_LAYERS - 1}."
    own = {
        p: names[id(v)]
        for p, v in value_of.items()
        if isinstance(v, torch.Tensor) and names.get(id(v), "").startswith(prefix)
    }
    original = set(graph.nodes)
    following = list(graph.nodes)[list(graph.nodes).index(last[-1]) + 1 :]  # what reads the last layer
    storages = _StorageKeys(graph, first, last)
    inputs = list(example_inputs)
    previous = dict(zip(first, last, strict=True))  # what the template read of the layer before it
    newest = list(last)
    # each copy's placeholders follow the layer before's, as dynamo orders a deep model's by first use
    anchor = max(own, key=placeholders.index) if own else placeholders[-1]
    position, after = placeholders.index(anchor) + 1, last[-1]
    for index in range(TRACED_LAYERS, layers.depth):
        weights: dict[fx.Node, fx.Node] = {}
        for node, name in own.items():
            with graph.inserting_after(anchor):
                anchor = weights[node] = graph.placeholder(f"{node.name}_{index}")
            anchor.meta = dict(node.meta)
            value = value_of[node]
            fresh = torch.empty(value.shape, dtype=value.dtype, device="meta")
            if isinstance(value, nn.Parameter):
                fresh = nn.Parameter(fresh, requires_grad=False)
            names[id(fresh)] = f"{layers.path}.{index}.{name[len(prefix) :]}"
            inputs.insert(position, fresh)
            position += 1
        copies: dict[fx.Node, fx.Node] = {}

        def remap(arg: fx.Node) -> fx.Node:
            return copies.get(arg) or weights.get(arg) or previous.get(arg, arg)  # noqa: B023

        for node in last:
            with graph.inserting_after(after):
                after = copies[node] = graph.node_copy(node, remap)
        storages.tag_copies(copies, index)
        newest = [copies[n] for n in last]
        previous = dict(zip(first, newest, strict=True))
    # what read the last traced layer now reads the last copy
    storages.tag_following(following, layers.depth - 1)
    final = dict(zip(last, newest, strict=True))
    for node in last:
        for user in [u for u in node.users if u in original and u not in final]:
            user.replace_input_with(node, final[node])
    graph.lint()
    return inputs


class _StorageKeys:
    """Storage keys for the copies of a layer's nodes (``graphs.STORAGE_KEYS``): a copy's traced values
    are the template's fake tensors, so without them every copy would share the template's storages. In
    copy ``i``, a storage the template layer allocated is ``(i, key)``; one it read from the layer before
    is the corresponding storage of copy ``i - 1`` (the template for the first copy)."""

    def __init__(self, graph: fx.Graph, first: list[fx.Node], last: list[fx.Node]) -> None:
        self.owner: dict[Any, fx.Node | None] = {}  # storage -> the node that allocated it; None: an input's
        inputs = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
        for node in inputs + [n for n in graph.nodes if n.op != "output" and n not in inputs]:
            for key in storage_keys(node):
                self.owner.setdefault(key, None if node in inputs else node)
        self.template, self.last = set(last), last
        self.before = {node: j for j, node in enumerate(first)}
        # read once: a fake tensor's storage takes tens of microseconds, and 80 layers copy ~100 nodes each
        self.template_keys = {node: storage_keys(node) for node in last}
        self.first_keys = {node: storage_keys(node) for node in first}
        self.previous = self.template_keys  # keys of the layer before a copy

    def tag_copies(self, copies: dict[fx.Node, fx.Node], index: int) -> None:
        keys_now = {}
        for node in self.last:
            keys = [self._key(key, index) for key in self.template_keys[node]]
            copies[node].meta[STORAGE_KEYS] = keys_now[node] = keys
        self.previous = keys_now

    def tag_following(self, following: list[fx.Node], final: int) -> None:
        """Nodes after the layers that view what the template layer allocated view the last copy's."""
        for node in following:
            keys = storage_keys(node)
            if any(self.owner.get(key) in self.template for key in keys):
                node.meta[STORAGE_KEYS] = [
                    (final, key) if self.owner.get(key) in self.template else key for key in keys
                ]

    def _key(self, key: Any, index: int) -> Any:
        owner = self.owner.get(key)
        if owner in self.template:
            return (index, key)
        if owner in self.before:
            counterpart = self.last[self.before[owner]]
            return self.previous[counterpart][self.first_keys[owner].index(key)]
        return key


def _layer_nodes(graph: fx.Graph, path: str) -> list[fx.Node]:
    """The nodes (no placeholders) dynamo recorded inside the module at ``path``, in order."""
    suffix = f".{path}"
    return [
        n
        for n in graph.nodes
        if n.op not in ("placeholder", "output")
        and any(p == path or p.endswith(suffix) for p, _ in (n.meta.get("nn_module_stack") or {}).values())
    ]
