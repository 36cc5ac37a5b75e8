"""The uses of a weight that tiles of its rows can serve: projections by it, directly or through a
conversion of its dtype (``W.float()``, ``W.to(dtype)``), each tile then converting its own rows
(``tile_products``); and the first use that cannot be served, named in a refusal.
"""

from __future__ import annotations

import torch
from torch import fx

from fxoffload_hf.graphs import is_method_of, is_row_lookup, traced_value

_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)


def is_projection_of(user: fx.Node, weight: fx.Node) -> bool:
    """Whether ``user`` is ``linear(x, weight[, bias])`` with ``weight`` only as its weight."""
    if user.op != "call_function" or user.target not in _LINEAR:
        return False
    args = [*user.args, *user.kwargs.values()]
    return len(user.args) >= 2 and user.args[1] is weight and args.count(weight) == 1


# conversions of a weight a tile can make of its own rows (``tile_linear``'s ``dtype``)
_CONVERSIONS = frozenset({"to", "float", "double", "half", "bfloat16"})


def conversion_of(user: fx.Node, weight: fx.Node) -> torch.dtype | None:
    """The dtype ``user`` converts ``weight`` to, where it is ``weight.float()`` (``double``, ``half``,
    ``bfloat16``) or ``weight.to(dtype)``, nothing else changed; else None."""
    if not is_method_of(user, weight, _CONVERSIONS):
        return None
    rest = [*user.args[1:], *user.kwargs.values()]
    if user.target == "to" and not (
        len(rest) == 1 and isinstance(rest[0], torch.dtype) and set(user.kwargs) <= {"dtype"}
    ):
        return None
    if user.target != "to" and rest:
        return None
    before, after = traced_value(weight), traced_value(user)
    if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor):
        return None
    same = tuple(before.shape) == tuple(after.shape) and before.device == after.device
    return after.dtype if same else None


def _converted_projections(user: fx.Node, weight: fx.Node) -> list[fx.Node]:
    """Where ``user`` converts ``weight`` and only projections by the converted weight read it: those."""
    if conversion_of(user, weight) is None or not user.users:
        return []
    projections = list(user.users)
    return projections if all(is_projection_of(p, user) for p in projections) else []


def projections(weight: fx.Node) -> list[tuple[fx.Node, torch.dtype | None]]:
    """Each projection by ``weight``, with the dtype it converts the weight to first (None: none)."""
    found: list[tuple[fx.Node, torch.dtype | None]] = []
    for user in weight.users:
        if is_projection_of(user, weight):
            found.append((user, None))
        for projection in _converted_projections(user, weight):
            found.append((projection, conversion_of(user, weight)))
    return found


def compute_dtype(weight: fx.Node) -> torch.dtype | None:
    """The widest dtype a projection converts ``weight`` to (what its tiles hold converted), or None."""
    dtypes = [d for _, d in projections(weight) if d is not None and d != traced_value(weight).dtype]
    return max(dtypes, key=lambda d: d.itemsize, default=None)


def blocking_use(weight: fx.Node) -> fx.Node | None:
    """The first use of ``weight`` that tiles cannot serve (neither a projection by it, nor one by its
    conversion to another dtype, nor a row lookup), or None when every use can be served."""
    for user in weight.users:
        served = is_projection_of(user, weight) or is_row_lookup(user, weight)
        if not served and not _converted_projections(user, weight):
            return user
    return None


def describe(node: fx.Node) -> str:
    """A user's name for an fx node's operation."""
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    return f"`{name}` ({node.op.replace('_', ' ')})"
