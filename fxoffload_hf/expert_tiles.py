"""Stacked expert weights too large for a piece, streamed in tiles of whole experts.

Transformers keeps a mixture-of-experts layer's experts as one stacked weight (experts x out x in) and
computes them with one grouped product, ``grouped_mm(tokens, weight[.transpose(-2, -1)], offs=ends)``:
the tokens sorted by expert, ``ends`` where each expert's tokens end. Each expert's product reads only its
own tokens and its own slab of the weight, so a tile of consecutive experts computes its rows of the
output alone: the same products of the same shapes, bit for bit as the whole (``tile_grouped_mm``; checked
for Transformers' fallback and PyTorch's grouped product in ``tests/test_expert_tiles.py``). A tile is a
byte range of the weight's file like any other (``WeightStore.add_tile``), held once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import fx

from fxoffload_hf.graphs import tile_placeholders, traced_value, value_bytes

_TRANSPOSE = {"transpose", torch.transpose, torch.Tensor.transpose}


def _grouped_products() -> dict[str, Callable[..., torch.Tensor]]:
    """The grouped products a traced experts module may call, by the name ``tile_grouped_mm`` is given:
    PyTorch's own, and Transformers' fallback (registered when its experts integration is imported)."""
    products: dict[str, Callable[..., torch.Tensor]] = {"_grouped_mm": torch._grouped_mm}
    grouped = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped is not None:
        products["grouped_mm"] = grouped
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        products["fallback"] = fallback
    return products


def _names_of_targets() -> dict[object, str]:
    """Each grouped product's name by the targets a traced graph calls it as (an op by its overload too)."""
    names: dict[object, str] = {}
    for name, product in _grouped_products().items():
        names[product] = name
        if isinstance(product, torch._ops.OpOverloadPacket):
            names[product.default] = name
    return names


def _offsets(node: fx.Node) -> fx.Node | None:
    """The ``offs`` argument of a grouped product node, where it takes nothing else than its two
    operands and ``offs`` (no bias, no output dtype)."""
    extra = {k: v for k, v in node.kwargs.items() if k != "offs" and v is not None}
    offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    if extra or len(node.args) > 3 or not isinstance(offs, fx.Node):
        return None
    return offs


def _transposes_last_two(node: fx.Node) -> bool:
    """Whether ``node`` is ``x.transpose(-2, -1)`` of a 3-D ``x`` (either order of the two)."""
    if node.op not in ("call_method", "call_function") or node.target not in _TRANSPOSE:
        return False
    dims = {d % 3 if isinstance(d, int) else d for d in [*node.args[1:], *node.kwargs.values()]}
    return len(node.args) >= 1 and dims == {1, 2}


def grouped_uses(weight: fx.Node) -> list[tuple[fx.Node, bool]] | None:
    """Each grouped product ``weight`` is the stacked operand of, and whether through a transpose of its
    last two dimensions; None where any use is something else (it cannot stream in tiles of experts)."""
    targets = _names_of_targets()
    uses: list[tuple[fx.Node, bool]] = []
    for user in weight.users:
        transposed = _transposes_last_two(user) and user.args[0] is weight
        products = list(user.users) if transposed else [user]
        if not products:
            return None
        for product in products:
            operand = user if transposed else weight
            if product.op != "call_function" or product.target not in targets:
                return None
            if len(product.args) < 2 or product.args[1] is not operand or product.args[0] is operand:
                return None
            if _offsets(product) is None:
                return None
            uses.append((product, transposed))
    return uses or None


def can_tile_experts(weight: fx.Node, shape: Sequence[int]) -> bool:
    """Whether a weight of ``shape`` can stream in tiles of whole experts: 3-D, and every use of it the
    stacked operand of a grouped product."""
    return len(shape) == 3 and grouped_uses(weight) is not None


def split_experts(
    gm: fx.GraphModule, weight: fx.Node, ranges: Sequence[tuple[int, int]]
) -> list[tuple[int, int, fx.Node]]:
    """Rewrite every grouped product of ``weight`` in ``gm`` as a chain of ``tile_grouped_mm`` calls, one
    per range of experts, each reading a new placeholder (appended after the graph's own) and filling its
    rows of the first call's output. Returns each tile's (first expert, one past the last, placeholder)."""
    graph = gm.graph
    uses = grouped_uses(weight)
    assert uses is not None, f"{weight.name}: not only grouped products"
    experts = int(traced_value(weight).shape[0])
    tiles = tile_placeholders(graph, weight, ranges, "experts")
    names = _names_of_targets()
    for product, transposed in uses:
        offs, name = _offsets(product), names[product.target]
        filled: fx.Node | None = None
        with graph.inserting_before(product):
            for start, _stop, tile in tiles:
                args = (product.args[0], tile, offs, start, experts, transposed, name, filled)
                filled = graph.call_function(tile_grouped_mm, args)
                filled.meta["example_value"] = traced_value(product)
        assert filled is not None
        product.replace_all_uses_with(filled)
        graph.erase_node(product)
    for user in [u for u in weight.users if not u.users]:
        graph.erase_node(user)  # the transposes the products read
    return tiles


@torch.compiler.disable
def tile_grouped_mm(
    tokens: torch.Tensor,
    tile: torch.Tensor,
    ends: torch.Tensor,
    start: int,
    experts: int,
    transposed: bool,
    product: str,
    filled: torch.Tensor | None,
) -> torch.Tensor:
    """The grouped ``product`` (``_grouped_products``) of ``tokens`` and ``W[.transpose(-2, -1)]`` with
    ``offs=ends`` for a stacked ``W`` of ``experts`` experts of
    which only ``tile`` (its experts from ``start``) is given: exact in the rows of those experts' tokens.
    The first tile's call returns the whole output (zeros in the other rows, as the whole product leaves
    the rows past the last expert's); each later one fills its rows of ``filled`` and returns it."""
    count = tile.shape[0]
    weight = tile.transpose(-2, -1) if transposed else tile
    if filled is None:
        filled = tokens.new_zeros(tokens.shape[0], weight.shape[-1])
    bounds = ends.tolist()
    first = 0 if start == 0 else int(bounds[start - 1])
    last = int(bounds[start + count - 1])
    if last > first:
        filled[first:last] = _grouped_products()[product](
            tokens[first:last], weight, offs=ends[start : start + count] - first
        )
    return filled


def extra_activation_bytes(weight: fx.Node) -> int:
    """What tiling ``weight`` adds to the activations: one more output of its largest grouped product
    while a tile computes beside the output being filled."""
    uses = grouped_uses(weight) or []
    return max((value_bytes(traced_value(product)) for product, _ in uses), default=0)
