"""The resource partitioner: cut a graph into sequential pieces whose weights fit a byte budget.

Pure: a graph, the bytes of each weight node and a budget in, pieces out; no IO, devices or timing.

The graph is first grouped into *atoms*, runs of nodes that must share a piece, laid out in an order
that is itself topological:

- a node's ``getitem`` users (a tuple is never split from its parts);
- its *epilogue*: the chain of cheap pointwise or view ops that alone consume its result (a projection
  with its bias add and activation, a norm with its scale);
- *free* nodes, whose inputs are only weights or other free nodes (a transposed weight, an
  ``arange``): pulled forward to just before their first user, so a weight never travels
  into a piece that does not load it;
- *stateful regions*, from a node that changes interpreter state to the node that restores it (a vmap
  or other functorch level, autocast, a grad-mode switch): one atom, never cut, never reordered.

Pieces are then contiguous runs of atoms, filled greedily, so they are topologically ordered by
construction and fusion groups are never split. Every step touches each node and edge a bounded number
of times: the work is linear in the size of the graph.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import fx

from fxoffload_hf.memory_model import BudgetTooSmallError, format_bytes

_EPILOGUE_FUNCTIONS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.neg,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.neg,
    torch.tanh,
    torch.sigmoid,
    torch.relu,
    torch.rsqrt,
    torch.pow,
    torch.nn.functional.gelu,
    torch.nn.functional.silu,
    torch.nn.functional.relu,
    torch.nn.functional.dropout,
    torch.nn.functional.softmax,
    torch.reshape,
    torch.flatten,
    torch.transpose,
    torch.permute,
}
_EPILOGUE_METHODS = {
    "add", "sub", "mul", "div", "neg", "tanh", "sigmoid", "relu", "pow", "rsqrt", "to", "float", "half",
    "bfloat16", "type", "type_as", "contiguous", "view", "reshape", "transpose", "permute", "flatten",
    "unsqueeze", "squeeze", "expand",
}  # fmt: skip


@dataclass
class Piece:
    """A run of nodes that load their weights together."""

    index: int
    nodes: list[fx.Node] = field(default_factory=list)
    weights: list[fx.Node] = field(default_factory=list)
    weight_bytes: int = 0


@dataclass
class Partition:
    """The pieces, in execution order, and how much work it took to find them."""

    pieces: list[Piece]
    budget: int
    largest_atom_bytes: int
    work: int

    def forget_nodes(self) -> None:
        """Drop the graph's nodes (kept: sizes and budgets), so the captured graph can be freed."""
        for piece in self.pieces:
            piece.nodes, piece.weights = [], []

    def piece_of(self) -> dict[fx.Node, int]:
        return {node: piece.index for piece in self.pieces for node in piece.nodes}


def _is_compute(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


# Calls that enter (+1) or leave (-1) a region of interpreter state; a grad-mode switch is emitted in
# pairs (switch, restore), so it enters when outside such a pair and leaves when inside.
_REGION_STEPS = {
    "_enter_autocast": 1,
    "_exit_autocast": -1,
    "_vmap_increment_nesting": 1,
    "_vmap_decrement_nesting": -1,
    "_grad_increment_nesting": 1,
    "_grad_decrement_nesting": -1,
    "_jvp_increment_nesting": 1,
    "_jvp_decrement_nesting": -1,
    "_func_increment_nesting": 1,
    "_func_decrement_nesting": -1,
}
_TOGGLES = {"_set_grad_enabled"}


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _mutates(node: fx.Node) -> bool:
    """In-place ops and setitem: they change an input."""
    name = _name(node)
    return node.target is operator.setitem or (name.endswith("_") and not name.endswith("__"))


def _changes_state(node: fx.Node) -> bool:
    name = _name(node)
    return name in _REGION_STEPS or name in _TOGGLES


def _has_side_effects(node: fx.Node) -> bool:
    """In-place ops, state switches and calls whose result nobody uses: never moved from where dynamo
    put them."""
    return _mutates(node) or _changes_state(node) or not node.users


def merge_stateful_regions(atoms: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Atoms joined from each state change to its restore, so no piece boundary falls inside one."""
    merged: list[list[fx.Node]] = []
    depth, toggled = 0, False
    for atom in atoms:
        if depth > 0 or toggled:
            merged[-1].extend(atom)
        else:
            merged.append(list(atom))
        for node in atom:
            name = _name(node)
            if name in _TOGGLES:
                toggled = not toggled
            depth = max(0, depth + _REGION_STEPS.get(name, 0))
    return merged


def _is_epilogue_op(node: fx.Node) -> bool:
    if _has_side_effects(node):
        return False
    if node.op == "call_function":
        return node.target in _EPILOGUE_FUNCTIONS
    return node.op == "call_method" and node.target in _EPILOGUE_METHODS


class _Grouper:
    """Lays the graph out as atoms; counts every node and edge it visits in ``work``."""

    def __init__(self, graph: fx.Graph, weights: Mapping[fx.Node, int]) -> None:
        self.nodes = list(graph.nodes)
        self.weights = weights
        self.work = 0
        self.segment = self._state_segments()
        self.free = self._free_nodes()
        self.emitted: set[fx.Node] = set()

    def _state_segments(self) -> dict[fx.Node, int]:
        """Each node's count of state changes before it: nodes are only moved within their segment,
        so nothing runs under an autocast, grad mode or functorch level it was not traced in."""
        segment: dict[fx.Node, int] = {}
        changes = 0
        for node in self.nodes:
            self.work += 1
            changes += _is_compute(node) and _changes_state(node)
            segment[node] = changes
        return segment

    def _free_nodes(self) -> set[fx.Node]:
        # a value that something mutates in place must be read where dynamo put the read
        self.mutated: set[fx.Node] = set()
        for node in self.nodes:
            self.work += 1 + len(node._input_nodes)
            if _is_compute(node) and _mutates(node):
                self.mutated.update(node._input_nodes)
        free: set[fx.Node] = set()
        for node in self.nodes:
            self.work += 1 + len(node._input_nodes) + len(node.users)
            if (
                _is_compute(node)
                and not _has_side_effects(node)
                and all((i in self.weights and i not in self.mutated) or i in free for i in node._input_nodes)
                and all(self.segment[u] == self.segment[node] for u in node.users)
            ):
                free.add(node)
        return free

    def atoms(self) -> list[list[fx.Node]]:
        result = []
        for node in self.nodes:
            self.work += 1
            if not _is_compute(node) or node in self.emitted or node in self.free:
                continue
            atom: list[fx.Node] = []
            self._emit(node, atom)
            self._emit_followers(node, atom)
            result.append(atom)
        # free nodes nobody computes on (e.g. returned as outputs) still need a home
        leftovers = [n for n in self.nodes if _is_compute(n) and n not in self.emitted]
        for node in leftovers:
            atom = []
            self._emit(node, atom)
            result.append(atom)
        return merge_stateful_regions(result)

    def _emit(self, node: fx.Node, atom: list[fx.Node]) -> None:
        """Emit ``node`` after the free nodes it needs that are not emitted yet (iteratively)."""
        stack: list[tuple[fx.Node, bool]] = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if current in self.emitted:
                continue
            if expanded:
                self.emitted.add(current)
                atom.append(current)
                continue
            stack.append((current, True))
            for dep in current._input_nodes:
                self.work += 1
                if dep in self.free and dep not in self.emitted:
                    stack.append((dep, False))

    def _emit_followers(self, anchor: fx.Node, atom: list[fx.Node]) -> None:
        current = anchor
        while True:
            users = list(current.users)
            self.work += 1 + len(users)
            getitems = [u for u in users if u.op == "call_function" and u.target is operator.getitem]
            if getitems:
                for item in getitems:
                    if self._ready(item):
                        self._emit(item, atom)
                return
            if len(users) != 1:
                return
            (user,) = users
            if (
                user in self.emitted
                or not _is_epilogue_op(user)
                or self.segment[user] != self.segment[anchor]
                or not self._ready(user)
            ):
                return
            self._emit(user, atom)
            current = user

    def _ready(self, node: fx.Node) -> bool:
        """All of ``node``'s inputs are available once its free inputs are emitted."""
        for dep in node._input_nodes:
            self.work += 1
            if dep in self.mutated:
                return False
            if dep.op in ("placeholder", "get_attr") or dep in self.emitted or dep in self.free:
                continue
            return False
        return True


def partition_graph(
    graph: fx.Graph,
    weight_bytes: Mapping[fx.Node, int],
    budget: int,
    *,
    max_atom: int | None = None,
    names: Mapping[fx.Node, str] | None = None,
) -> Partition:
    """Cut ``graph`` into sequential pieces whose weights (nodes in ``weight_bytes``) fit ``budget``.

    A weight used by several pieces counts in each of them. Pieces are in a valid execution order, and
    two consecutive pieces together take at most ``max(2 * budget, largest atom + budget)``. An atom
    larger than ``budget`` but not than ``max_atom`` (default: ``budget``) gets a piece of its own.

    Raises:
        BudgetTooSmallError: an atom's weights exceed ``max_atom``; the message names its largest weight
            and the smallest budget that works.
    """
    max_atom = budget if max_atom is None else max_atom
    grouper = _Grouper(graph, weight_bytes)
    atoms = grouper.atoms()
    work = grouper.work

    atom_weights: list[list[fx.Node]] = []
    largest, largest_atom = 0, -1
    for index, atom in enumerate(atoms):
        seen: dict[fx.Node, None] = {}
        for node in atom:
            for dep in node._input_nodes:
                work += 1
                if dep in weight_bytes:
                    seen[dep] = None
        weights = list(seen)
        atom_weights.append(weights)
        size = sum(weight_bytes[w] for w in weights)
        if size > largest:
            largest, largest_atom = size, index
    if largest > max_atom:
        heaviest = max(atom_weights[largest_atom], key=lambda w: weight_bytes[w])
        raise BudgetTooSmallError(
            f"weight {(names or {}).get(heaviest, heaviest.name)!r} ({format_bytes(weight_bytes[heaviest])}, loaded together with "
            f"{len(atom_weights[largest_atom]) - 1} other weight(s) of its op) does not fit the room of "
            f"{format_bytes(max_atom)} beside the activations; it needs {format_bytes(largest)}",
            smallest_budget=largest,
        )

    # two consecutive pieces are in memory at once: after a piece of s bytes the next may take only
    # pair_budget - s, so one large unsplittable weight (an embedding) does not double the staging need
    pair_budget = max(2 * budget, largest + budget)
    limit = budget
    pieces = [Piece(0)]
    in_piece: set[fx.Node] = set()
    for atom, weights in zip(atoms, atom_weights, strict=True):
        new = [w for w in weights if w not in in_piece]
        added = sum(weight_bytes[w] for w in new)
        work += 1 + len(weights)
        piece = pieces[-1]
        if piece.nodes and added and piece.weight_bytes + added > limit:
            limit = max(min(budget, pair_budget - piece.weight_bytes), 1)
            piece = Piece(len(pieces))
            pieces.append(piece)
            in_piece = set()
            new, added = weights, sum(weight_bytes[w] for w in weights)
        piece.nodes.extend(atom)
        piece.weights.extend(new)
        piece.weight_bytes += added
        in_piece.update(new)
    if not pieces[0].nodes:
        pieces = []
    return Partition(pieces, budget, largest, work)
