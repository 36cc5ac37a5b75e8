"""A captured graph cut into pieces, as the runner runs it: a list of steps, built once per graph.

The partition's pieces become submodules (``torch.fx.passes.split_module``), each compiled as the
configuration asks; the top-level graph becomes a list of ``Step``s that say which values each needs,
which weights it takes, and which values die after it. The program keeps no reference to the captured
graph's nodes beyond the split graph's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import fx
from torch.fx.passes.split_module import split_module

from fxoffload_hf.graphs import GraphFacts, last_uses
from fxoffload_hf.integrations.piece_compilers import compile_piece
from fxoffload_hf.partition import Partition


@dataclass(frozen=True)
class Step:
    """One top-level node of the split graph."""

    node: fx.Node
    piece: int | None  # position among the pieces in execution order, or None
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    frees: tuple[fx.Node, ...]
    weights: tuple[str | None, ...] = ()  # for each argument of a piece, the weight it is, or None


@dataclass(frozen=True)
class Program:
    """The steps of one graph, its pieces' weights, and where its inputs and output come from."""

    steps: tuple[Step, ...]
    inputs: tuple[tuple[fx.Node, int], ...]  # non-weight placeholders and their argument positions
    weight_inputs: dict[fx.Node, int]  # weight placeholders (used only where the output returns one)
    output: Any  # the output node's argument: a structure of nodes
    piece_names: tuple[tuple[str, ...], ...]  # the weights of each piece, in execution order

    @property
    def pieces(self) -> int:
        return len(self.piece_names)


def build_program(
    gm: fx.GraphModule, partition: Partition, facts: GraphFacts, compile: str | None
) -> Program:
    """Split ``gm`` along ``partition`` and list its steps."""
    piece_of = partition.piece_of()
    split = split_module(gm, gm, (lambda n: 0) if len(partition.pieces) <= 1 else (lambda n: piece_of[n]))
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    top = [n for n in split.graph.nodes if n.op == "placeholder"]
    weight_top = {n for n in top if by_name.get(n.name) in facts.names}
    frees = {
        user: tuple(v for v in values if v not in weight_top)
        for user, values in last_uses(split.graph).items()
    }
    steps: list[Step] = []
    piece_names: list[tuple[str, ...]] = []
    for node in split.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        piece = None
        weights: tuple[str | None, ...] = ()
        if node.op == "call_module":
            piece = len(piece_names)
            weights = tuple(facts.names[by_name[a.name]] if a in weight_top else None for a in node.args)
            piece_names.append(tuple(w for w in weights if w is not None))
            fn = compile_piece(getattr(split, node.target), compile)
        elif node.op == "call_function":
            fn = node.target
        else:
            raise NotImplementedError(f"unexpected top-level node {node.op} in split graph")
        steps.append(Step(node, piece, fn, tuple(node.args), frees.get(node, ()), weights))
    _drop_meta(split)
    output = next(n for n in split.graph.nodes if n.op == "output")
    positions = {n: i for i, n in enumerate(top)}
    return Program(
        steps=tuple(steps),
        inputs=tuple((n, positions[n]) for n in top if n not in weight_top),
        weight_inputs={n: positions[n] for n in weight_top},
        output=output.args[0],
        piece_names=tuple(piece_names),
    )


def _drop_meta(split: fx.GraphModule) -> None:
    """Free the fake example values the split graphs carry: running them needs none."""
    for module in [split, *split.children()]:
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.meta = {}
