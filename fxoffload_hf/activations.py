"""A graph's activation peak as a function of its sizes, so every call is measured, not just the first.

Sizes are symbolic from the first call (``capture``): one graph serves every batch and length, and a
batch of 32 reuses the graph captured for a batch of 3. The peak at the capture's sizes would then
understate what a later call holds. Walking the graph once, the live bytes after each node are a
polynomial in the size symbols; the few that are largest somewhere (probed at the capture's sizes and
multiples of them) are kept, compiled to plain Python, and evaluated with each call's sizes, read from
its arguments.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from fxoffload_hf.graphs import call_inputs, storage_walk, traced_value

_PROBE_SCALES = (1, 2, 8, 64)  # each symbol at these multiples of its capture size, in all combinations
_MAX_PROBED_SYMBOLS = 4  # beyond that the combinations are too many: probe all symbols scaled together
# torch's sympy functions that size expressions use, as plain Python
_FUNCTIONS: dict[str, Callable[..., int]] = {
    "FloorDiv": lambda a, b: a // b,
    "CleanDiv": lambda a, b: a // b,
    "IntTrueDiv": lambda a, b: a / b,
    "CeilDiv": lambda a, b: -(-a // b),
    "PythonMod": lambda a, b: a % b,
    "Mod": lambda a, b: a % b,
    "Max": max,
    "Min": min,
    "TruncToInt": math.trunc,
    "CeilToInt": math.ceil,
    "FloorToInt": math.floor,
}


@dataclass(frozen=True)
class ActivationModel:
    """Peak bytes of a graph's live intermediates for the sizes of a call (its graph arguments)."""

    at_capture: int
    peaks: Callable[..., tuple[Any, ...]] | None = None  # of the symbols' values: the candidate peaks
    sources: tuple[tuple[int, int | None], ...] = ()  # per symbol: argument position, tensor dim or None

    def __call__(self, args: Sequence[Any]) -> int:
        if self.peaks is None:
            return self.at_capture
        values = [args[pos] if dim is None else args[pos].shape[dim] for pos, dim in self.sources]
        return int(max(self.peaks(*values)))


def activation_model(gm: fx.GraphModule, weights: set[fx.Node], at_capture: int) -> ActivationModel:
    """The activation peak of ``gm`` as a function of its size symbols; ``at_capture`` (the peak at the
    capture's sizes) stands for every call when the graph has no symbols or they cannot be read."""
    held = [_bytes_expr(traced_value(n)) for n in call_inputs(gm.graph, weights)]
    live: sympy.Expr = sympy.Add(*held)
    candidates: set[sympy.Expr] = {live}
    sizes: dict[fx.Node, sympy.Expr] = {}
    for step in storage_walk(gm.graph, weights):
        sizes[step.node] = _bytes_expr(step.new)
        if sizes[step.node] != 0:
            live = live + sizes[step.node]
            candidates.add(live)
        for value in step.frees:
            live = live - sizes.pop(value, 0)
    symbols = sorted(set().union(*(c.free_symbols for c in candidates)), key=str)
    sources = _symbol_sources(gm)
    if not symbols or any(s not in sources for s in symbols):
        return ActivationModel(at_capture)
    hints = [sources[s][2] for s in symbols]
    try:
        ordered = sorted(candidates, key=str)
        kept = [ordered[i] for i in _largest_somewhere(_compile(symbols, ordered), hints)]
        peaks = _compile(symbols, kept)
        if int(max(peaks(*hints))) != at_capture:
            return ActivationModel(at_capture)  # the walk disagrees with the capture's: trust neither more
    except Exception:  # an expression plain Python cannot evaluate: the capture's peak, as before
        return ActivationModel(at_capture)
    return ActivationModel(at_capture, peaks, tuple((sources[s][0], sources[s][1]) for s in symbols))


def _compile(symbols: list[sympy.Symbol], exprs: list[sympy.Expr]) -> Callable[..., tuple[Any, ...]]:
    return sympy.lambdify(symbols, tuple(exprs), modules=[_FUNCTIONS, "math"])


def _bytes_expr(value: Any) -> sympy.Expr:
    if isinstance(value, torch.Tensor):
        count: sympy.Expr = sympy.Integer(1)
        for dim in value.shape:
            count = count * (sympy.Integer(dim) if isinstance(dim, int) else dim.node.expr)
        return count * value.element_size()
    if isinstance(value, list | tuple):
        return sympy.Add(*(_bytes_expr(v) for v in value))
    return sympy.Integer(0)


def _symbol_sources(gm: fx.GraphModule) -> dict[sympy.Symbol, tuple[int, int | None, int]]:
    """Where each size symbol can be read from a call's arguments (position, and the tensor dimension or
    None for a size argument), and its value at capture."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found: dict[sympy.Symbol, tuple[int, int | None, int]] = {}
    for position, node in enumerate(placeholders):
        traced = traced_value(node)
        # hints, never int() of a symbolic size: that would add a guard and specialise the graph
        if isinstance(traced, torch.SymInt) and isinstance(traced.node.expr, sympy.Symbol):
            found.setdefault(traced.node.expr, (position, None, int(traced.node.hint)))
        elif isinstance(traced, torch.Tensor):
            for dim, size in enumerate(traced.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    found.setdefault(size.node.expr, (position, dim, int(size.node.hint)))
    return found


def _largest_somewhere(values: Callable[..., tuple[Any, ...]], hints: list[int]) -> list[int]:
    """Indices of the candidates that are the largest at one probe point at least."""
    if len(hints) <= _MAX_PROBED_SYMBOLS:
        grid: Any = itertools.product(_PROBE_SCALES, repeat=len(hints))
    else:
        grid = ((k,) * len(hints) for k in _PROBE_SCALES)
    kept: set[int] = set()
    for scales in grid:
        at_point = values(*(max(h, 1) * k for h, k in zip(hints, scales, strict=True)))
        kept.add(max(range(len(at_point)), key=at_point.__getitem__))
    return sorted(kept)
