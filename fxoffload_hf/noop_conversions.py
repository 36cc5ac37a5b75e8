"""Conversions of a weight to what it is already, dropped from a captured graph.

``weight.to(x.dtype)`` or ``weight.float()`` of a weight already of that dtype returns the weight
itself, yet dynamo records it as a node between the weight and its projection, and a weight used by
anything but projections and lookups cannot stream in tiles (``projections.blocking_use``). Ergo's output
head computes ``F.linear(x.float(), weight.to(x.dtype).float())``: in fp32 both conversions return the
weight, and its 62.5 MiB head (vocabulary 32,000, width 512) had to fit whole. A conversion that changes
the dtype is kept: tiles convert their own rows where only projections read it (``projections``).
"""

from __future__ import annotations

import torch
from torch import fx

from fxoffload_hf.graphs import is_method_of, traced_value

# tensor methods that return the tensor itself where it is of the dtype, device and layout asked for
_RETURN_SELF = frozenset({"to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous"})


def is_noop_conversion(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` is a conversion of ``source`` that returns ``source`` itself."""
    # one argument at most (a dtype, device or tensor): ``to``'s later positions are ``non_blocking``
    # and ``copy``, and a copy is not the weight
    if not is_method_of(node, source, _RETURN_SELF) or len(node.args) > 2:
        return False
    if node.kwargs.get("copy") or node.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    before, after = traced_value(source), traced_value(node)
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and (before.dtype, before.device, before.layout) == (after.dtype, after.device, after.layout)
        and tuple(before.shape) == tuple(after.shape)
        and tuple(before.stride()) == tuple(after.stride())
    )


def has_noop_conversions(weights: list[fx.Node]) -> bool:
    """Whether a user of one of ``weights`` is a conversion to what it is already."""
    return any(is_noop_conversion(user, weight) for weight in weights for user in weight.users)


def drop_noop_conversions(graph: fx.Graph, weights: list[fx.Node]) -> int:
    """Read each of ``weights`` where a conversion of it to what it is already was read (chains of them
    too), and erase the conversions; in place. How many were erased."""
    erased = 0
    for weight in weights:
        found = True
        while found:
            found = False
            for user in list(weight.users):
                if is_noop_conversion(user, weight):
                    user.replace_all_uses_with(weight)
                    graph.erase_node(user)
                    erased += 1
                    found = True
    return erased
