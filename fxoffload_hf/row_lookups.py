"""Embedding lookups on CUDA that gather their rows where the table lies.

A table the graph only looks rows up in (token and position embeddings) need not reach the device
whole: the lookup's ids are copied to the host, the rows they name are gathered from the table there
(pinned RAM, or the checkpoint's mapped pages) and only those rows are copied to the device. A gather is
exact, so the result is eager's bit for bit. The cost is one device-to-host copy of the ids, which waits
for the compute that made them (``generate`` waits for each step's tokens anyway).

Every lookup of a weight on a CUDA run is rewritten (``gather_on_host``): when the schedule keeps the
table on the device, ``gather_rows`` is the plain lookup there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

# op: position of the table among its arguments (``embedding(input, weight, ...)`` for the functional
# form, ``embedding(weight, indices, ...)`` for the others)
LOOKUPS: dict[Any, int] = {
    torch.nn.functional.embedding: 1,
    torch.embedding: 0,
    torch.ops.aten.embedding.default: 0,
}


@torch.compiler.disable
def gather_rows(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``embedding(ids, table)`` computed where ``table`` lies and returned where ``ids`` are (a padding
    index changes only gradients, which streamed weights do not take)."""
    if table.device == ids.device:
        return torch.nn.functional.embedding(ids, table)
    return torch.nn.functional.embedding(ids.to(table.device), table).to(ids.device)


LOOKUPS[gather_rows] = 1


def _plain_lookup(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """``(ids, table)`` of a lookup that only reads rows (no ``max_norm``, which writes the table), else
    None."""
    if node.op != "call_function" or node.target not in LOOKUPS or node.target is gather_rows:
        return None
    args = dict(enumerate(node.args))
    if node.target is torch.nn.functional.embedding:
        names = ("input", "weight", "padding_idx", "max_norm")
        ids, table, _, max_norm = (args.get(i, node.kwargs.get(n)) for i, n in enumerate(names))
    else:  # embedding(weight, indices, ...)
        table, ids, max_norm = (
            args.get(0, node.kwargs.get("weight")),
            args.get(1, node.kwargs.get("indices")),
            None,
        )
    if max_norm is not None or not isinstance(ids, fx.Node) or not isinstance(table, fx.Node):
        return None
    return ids, table


def gather_on_host(gm: fx.GraphModule, tables: set[fx.Node]) -> int:
    """Rewrite every lookup in ``gm`` whose table is one of ``tables`` as ``gather_rows``; returns how
    many were rewritten (``gm`` is recompiled when any was)."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        lookup = _plain_lookup(node)
        if lookup is None or lookup[1] not in tables:
            continue
        with gm.graph.inserting_before(node):
            gathered = gm.graph.call_function(gather_rows, lookup)
        gathered.meta.update(node.meta)
        node.replace_all_uses_with(gathered)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
