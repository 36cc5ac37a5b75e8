"""A deep model planned from a capture of its first few layers: what ``plan`` costs does not grow with depth.

Dynamo traces a repeated block once and stamps out the rest (``blocks``), but each stamp still costs it
a reuse check (about 0.1 s a layer here: most of a 70B plan), and where the check fails every layer is
traced. Most models have layers of a few kinds (sliding and full attention, dense and mixture-of-experts
layers, attention and linear attention); layers of one kind have one class, one parameter layout and the
same flags (``blocks.block_kinds``). ``plan`` builds the same model with its first few layers, as many as
hold, after the first layer, every kind of the layers after them, captures that, and for each missing
layer copies the nodes of the last traced layer of its kind in the fx graph (``deepen``), with a weight
placeholder of its own for each copy's weights, named as the deep model names them; a copy reads what its
template read of the layer before from the copy before it. The plan partitions that graph as it would
the deep model's. Anything unexpected (a shallow model whose layers are not the deep model's first ones,
a config that cannot shrink, traced layers of one kind whose nodes differ, a layer that reads more than
the one before it gives) yields None, and ``plan`` captures the deep model itself.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from fxoffload_hf.blocks import block_kinds
from fxoffload_hf.graphs import STORAGE_KEYS, storage_keys
from fxoffload_hf.kv_cache import text_config

TRACED_LAYERS = 2  # at least: the first, and one whose nodes are copied (it reads a layer before it)


@dataclass(frozen=True)
class Layers:
    """The decoder layers of a model: the path of their list, each layer's kind, and how many of the
    first are traced (after the first layer, every kind of the layers after them)."""

    path: str
    kinds: tuple[tuple[Any, ...], ...]
    traced: int

    @property
    def depth(self) -> int:
        return len(self.kinds)

    def templates(self) -> dict[tuple[Any, ...], int]:
        """Per kind, the last traced layer of it after the first: the layer its copies are made from."""
        return {self.kinds[k]: k for k in range(1, self.traced)}


def repeated_layers(model: nn.Module) -> Layers | None:
    """The one list of blocks, as long as the decoder is deep, whose first layers, fewer than all, hold
    after the first layer each kind of the layers after them; None where there is no such list, or
    several."""
    depth = (
        getattr(text_config(model.config), "num_hidden_layers", None) if hasattr(model, "config") else None
    )
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) != depth:
            continue
        kinds = block_kinds(module)
        traced = _traced_layers(kinds) if kinds else None
        if kinds and traced is not None:
            found.append(Layers(name, tuple(kinds), traced))
    return found[0] if len(found) == 1 else None


def _traced_layers(kinds: list[tuple[Any, ...]]) -> int | None:
    """How many first layers hold, after the first layer, every kind of the layers after them (at least
    ``TRACED_LAYERS``); None where that is all of them."""
    for traced in range(TRACED_LAYERS, len(kinds)):
        if set(kinds[traced:]) <= set(kinds[1:traced]):
            return traced
    return None


def shallow_config(config: Any, layers: int) -> Any | None:
    """A copy of ``config`` whose decoder has ``layers`` layers (per-layer lists cut alike), or None."""
    shallow = copy.deepcopy(config)
    text = text_config(shallow)
    depth = getattr(text, "num_hidden_layers", None)
    if not isinstance(depth, int):
        return None
    try:
        text.num_hidden_layers = layers
        # every per-layer list (layer types, MLP types, RoPE per layer): the shallow model must be the deep
        # one's first layers, which ``is_prefix`` checks once it is built
        for name, value in list(vars(text).items()):
            if isinstance(value, list) and len(value) == depth:
                setattr(text, name, value[:layers])
    except (AttributeError, TypeError, ValueError):  # derived, read-only or validated attributes
        return None
    return shallow


def is_prefix(small: nn.Module, layers: Layers) -> bool:
    """Whether ``small`` (a ``ModuleList``) holds the first ``layers.traced`` layers' kinds, in order,
    but for what a layer derives from the depth (MiniCPM's scale their residuals by it)."""
    kinds = block_kinds(small) if isinstance(small, nn.ModuleList) else None
    deep = layers.kinds[: layers.traced]
    return (
        kinds is not None
        and len(kinds) == len(deep)
        and all(_alike_but_depth(s, d, layers.traced, layers.depth) for s, d in zip(kinds, deep, strict=True))
    )


def _alike_but_depth(shallow: tuple[Any, ...], deep: tuple[Any, ...], traced: int, depth: int) -> bool:
    """Whether two kinds differ only in real-valued flags or in flags that are each model's depth:
    neither changes what a layer computes, only its values."""
    (cls, params, flags), (deep_cls, deep_params, deep_flags) = shallow, deep
    if cls is not deep_cls or params != deep_params or len(flags) != len(deep_flags):
        return False
    for (name, attr, value), (deep_name, deep_attr, deep_value) in zip(flags, deep_flags, strict=True):
        if (name, attr) != (deep_name, deep_attr):
            return False
        real = type(value) is float and type(deep_value) is float
        if value != deep_value and not real and (value, deep_value) != (traced, depth):
            return False
    return True


def deepen(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    names: dict[int, str],
    layers: Layers,
) -> list[Any] | None:
    """Copy, for each layer past the traced ones, the nodes of the last traced layer of its kind, until
    ``gm`` (captured with ``layers.traced`` layers) has ``layers.depth``, in place; the example inputs
    with a meta tensor for each new placeholder of a layer's weights and buffers, in the graph's order
    (``names``, of parameters and buffers, learns theirs). None where the traced layers of one kind do
    not match one for one, or a layer reads more of the layers than what the one before it hands on:
    ``gm`` untouched where the checks before copying find it, left part-deepened where a copy reads a
    storage the copy before it does not hand on (which they rule out); the caller then captures anew."""
    graph = gm.graph
    traced = [_layer_nodes(graph, f"{layers.path}.{k}") for k in range(layers.traced)]
    templates = layers.templates()
    handed = [_handed_on(nodes) for nodes in traced]  # what each layer's nodes give the nodes after it
    if not _copyable(graph, traced, handed, layers, templates):
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    value_of = dict(zip(placeholders, example_inputs, strict=False))
    own = {k: _own_placeholders(value_of, names, f"{layers.path}.{k}.") for k in set(templates.values())}
    last_own = _own_placeholders(value_of, names, f"{layers.path}.{layers.traced - 1}.")
    original = set(graph.nodes)
    storages = _StorageKeys(graph, traced)
    inputs = list(example_inputs)
    newest = handed[-1]  # what the layer before the next copy hands on
    # each copy's placeholders follow the layer before's, as dynamo orders a deep model's by first use
    anchor = max(last_own, key=placeholders.index) if last_own else placeholders[-1]
    position, after = placeholders.index(anchor) + 1, traced[-1][-1]
    for index in range(layers.traced, layers.depth):
        template = templates[layers.kinds[index]]
        prefix = f"{layers.path}.{template}."
        weights: dict[fx.Node, fx.Node] = {}
        for node, name in own[template].items():
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
        # what the template read of its layer before, read of the copy before this one
        before = dict(zip(handed[template - 1], newest, strict=True))
        copies: dict[fx.Node, fx.Node] = {}

        def remap(arg: fx.Node) -> fx.Node:
            return copies.get(arg) or weights.get(arg) or before.get(arg, arg)  # noqa: B023

        for node in traced[template]:
            with graph.inserting_after(after):
                after = copies[node] = graph.node_copy(node, remap)
        if not storages.tag_copies(traced[template], copies, handed[template - 1], newest, index):
            return None
        newest = [copies[n] for n in handed[template]]
    # what read the last traced layer now reads the last copy
    storages.tag_following(list(graph.nodes)[list(graph.nodes).index(after) + 1 :], handed[-1], newest)
    final = dict(zip(handed[-1], newest, strict=True))
    last_layer = set(traced[-1])
    for node in handed[-1]:
        for user in [u for u in node.users if u in original and u not in last_layer]:
            user.replace_input_with(node, final[node])
    graph.lint()
    return inputs


def _own_placeholders(value_of: dict[fx.Node, Any], names: dict[int, str], prefix: str) -> dict[fx.Node, str]:
    """The placeholders of the weights and buffers named under ``prefix`` (one layer's), with their names."""
    return {
        p: names[id(v)]
        for p, v in value_of.items()
        if isinstance(v, torch.Tensor) and names.get(id(v), "").startswith(prefix)
    }


def _handed_on(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes of a layer that nodes outside it read, in the graph's order."""
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


def _copyable(
    graph: fx.Graph,
    traced: list[list[fx.Node]],
    handed: list[list[fx.Node]],
    layers: Layers,
    templates: dict[tuple[Any, ...], int],
) -> bool:
    """Whether copies of the templates stand for the deep model's layers: every traced layer recorded,
    those of one kind recording the same ops, every layer handing on as many values, each template
    reading of the layers only what the layer before it hands on, and no node between the layers."""
    if any(not nodes for nodes in traced) or len({len(h) for h in handed}) != 1:
        return False
    for index, nodes in enumerate(traced):
        template = templates.get(layers.kinds[index])  # none for a kind only the first layer has
        if template is not None and [n.target for n in nodes] != [n.target for n in traced[template]]:
            return False
    in_layers = {n: k for k, nodes in enumerate(traced) for n in nodes}
    for template in set(templates.values()):
        inside = set(traced[template])
        read = {a for n in traced[template] for a in n.all_input_nodes if a not in inside and a in in_layers}
        if not read <= set(handed[template - 1]):
            return False
    # nothing computed between the layers: a layer may read it, or it may close what a layer opened
    # (dynamo's vmap nesting in Mamba's and Jamba's: copies of the layer alone would leave it open)
    order = {n: i for i, n in enumerate(graph.nodes)}
    start, end = order[traced[0][0]], order[traced[-1][-1]]
    between = [n for n in graph.nodes if start < order[n] < end and n not in in_layers]
    return not any(n.op not in ("placeholder", "get_attr") for n in between)


class _StorageKeys:
    """Storage keys for the copies of layers' nodes (``graphs.STORAGE_KEYS``): a copy's traced values are
    its template's fake tensors, so without them every copy would share its template's storages. In copy
    ``i``, a storage its template allocated is ``(i, key)``; one it read from the layer before is the
    storage at the same place in what the copy before it hands on."""

    def __init__(self, graph: fx.Graph, traced: list[list[fx.Node]]) -> None:
        self.owner: dict[Any, fx.Node | None] = {}  # storage -> the node that allocated it; None: an input's
        inputs = [n for n in graph.nodes if n.op in ("placeholder", "get_attr")]
        for node in inputs + [n for n in graph.nodes if n.op != "output" and n not in inputs]:
            for key in storage_keys(node):
                self.owner.setdefault(key, None if node in inputs else node)
        self.in_layers = {n for nodes in traced for n in nodes}
        # read once: a fake tensor's storage takes tens of microseconds, and 80 layers copy ~100 nodes each
        self.known: dict[fx.Node, list[Any]] = {}

    def tag_copies(
        self,
        template: list[fx.Node],
        copies: dict[fx.Node, fx.Node],
        read_before: list[fx.Node],
        newest: list[fx.Node],
        index: int,
    ) -> bool:
        """Tag copy ``index`` of ``template``'s nodes; False where it reads a layer's storage that the
        layer before it does not hand on."""
        handed = self._handed(read_before, newest)
        own = set(template)
        for node in template:
            keys = []
            for key in self._keys(node):
                owner = self.owner.get(key)
                if key is not None and owner in own:
                    keys.append((index, key))
                elif key is not None and owner in self.in_layers:
                    if key not in handed:
                        return False
                    keys.append(handed[key])
                else:
                    keys.append(key)
            copies[node].meta[STORAGE_KEYS] = keys
        return True

    def tag_following(self, following: list[fx.Node], last: list[fx.Node], newest: list[fx.Node]) -> None:
        """Nodes after the layers that view what the last traced layer hands on view the last copy's."""
        handed = self._handed(last, newest)
        for node in following:
            keys = storage_keys(node)
            if any(key in handed for key in keys):
                node.meta[STORAGE_KEYS] = [handed.get(key, key) for key in keys]

    def _handed(self, before: list[fx.Node], newest: list[fx.Node]) -> dict[Any, Any]:
        """The storages ``before`` hands on, each to the one at its place in what ``newest`` hands on."""
        return {
            old: new
            for b, n in zip(before, newest, strict=True)
            for old, new in zip(self._keys(b), self._keys(n), strict=False)
            if old is not None
        }

    def _keys(self, node: fx.Node) -> list[Any]:
        if node not in self.known:
            self.known[node] = storage_keys(node)
        return self.known[node]


def _layer_nodes(graph: fx.Graph, path: str) -> list[fx.Node]:
    """The nodes (no placeholders) dynamo recorded inside the module at ``path``, in order."""
    suffix = f".{path}"
    return [
        n
        for n in graph.nodes
        if n.op not in ("placeholder", "output")
        and any(p == path or p.endswith(suffix) for p, _ in (n.meta.get("nn_module_stack") or {}).values())
    ]
