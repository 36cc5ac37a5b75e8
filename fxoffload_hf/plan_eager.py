"""The smallest budget at which a model's calls run as eager code, planned without running them.

``capture="deferred"`` (the default) runs calls eagerly while they fit the budget: the call's bound
(``eager_memory``) beside the largest module lent its weights whole, or a plain projection too large for
that lent a tile of rows at a time (``eager_tiles``), and beside the small tensors. No graph's state is
held then, so for a short answer this floor can lie below the captured one (``plan``). Planned from the
model built on the meta device and one call of ``batch`` x ``seq_len`` token ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxoffload_hf.config import RESIDENT_THRESHOLD
from fxoffload_hf.eager_forwards import reads_rows
from fxoffload_hf.eager_memory import eager_call_bytes
from fxoffload_hf.eager_tiles import projects_by_rows, tile_held, tile_rows_for
from fxoffload_hf.memory_model import format_bytes, nbytes


@dataclass(frozen=True)
class EagerFloor:
    """The smallest budget of eager calls (None where a call cannot be bounded), and what sets it."""

    budget: int | None
    set_by: str


@dataclass(frozen=True)
class _Lent:
    """A module an eager call lends weights: its name, the bytes lent whole, and a 2-D weight a plain
    projection of it could lend in tiles (shape, itemsize), if any."""

    name: str
    whole: int
    tile_shape: tuple[int, ...] | None
    itemsize: int


def eager_floor(model: nn.Module, ids: torch.Tensor, fixed: int, device_type: str) -> EagerFloor:
    """The smallest budget at which ``model(ids)`` runs eagerly on ``device_type``, beside ``fixed`` bytes
    of small tensors (and no captured graph)."""
    bound = eager_call_bytes(model, (ids,), {}, device_type)
    if bound is None:
        return EagerFloor(None, "its calls cannot be bounded from the config and inputs: they are captured")
    rest = f"{format_bytes(bound)} of the call's activations and KV cache + {format_bytes(fixed)} of small tensors"
    lent = _lent_modules(model, device_type)
    if not lent:
        return EagerFloor(fixed + bound, rest)
    # the least room for weights beside the call where the largest module fits, projections too large
    # to lend whole there in tiles sized for that room (as ``Deferral`` sizes them); tiles shrink with it
    low, high = 0, max(m.whole for m in lent)
    while low < high:
        middle = (low + high) // 2
        if _in_tiles(lent, middle, device_type)[0] <= middle:
            high = middle
        else:
            low = middle + 1
    return EagerFloor(fixed + bound + low, f"{_in_tiles(lent, low, device_type)[1]} + {rest}")


def _in_tiles(lent: list[_Lent], room: int, device_type: str) -> tuple[int, str]:
    """The bytes the largest module holds in an eager call within ``room`` bytes for weights, with the
    projections too large to lend whole there in tiles (``eager_tiles``), and what it is."""
    held: list[tuple[int, str]] = []
    for module in lent:
        shape = module.tile_shape
        rows = (
            None if shape is None else tile_rows_for(shape, module.itemsize, module.whole, room, device_type)
        )
        if shape is None or rows is None:
            held.append((module.whole, f"{module.name} ({format_bytes(module.whole)}) lent whole"))
        else:
            tile = tile_held(shape, module.itemsize, module.whole, rows, device_type)
            held.append((tile, f"{module.name} in tiles of {rows} rows ({format_bytes(tile)} held at once)"))
    return max(held)


def _lent_modules(model: nn.Module, device_type: str) -> list[_Lent]:
    """The modules holding weights large enough to stream (``RESIDENT_THRESHOLD``), with what an eager
    call lends them whole: not a plain embedding's table, read by rows where it lies."""
    out = []
    for name, module in model.named_modules():
        if reads_rows(module, device_type):
            continue
        sizes = {
            attr: nbytes(p.shape, p.element_size())
            for attr, p in module._parameters.items()
            if p is not None and nbytes(p.shape, p.element_size()) >= RESIDENT_THRESHOLD
        }
        if not sizes:
            continue
        weight = module._parameters.get("weight")
        tileable = "weight" in sizes and projects_by_rows(module) and weight is not None
        out.append(
            _Lent(
                name=name or type(module).__name__,
                whole=sum(sizes.values()),
                tile_shape=tuple(weight.shape) if tileable else None,  # type: ignore[union-attr]
                itemsize=weight.element_size() if tileable else 0,  # type: ignore[union-attr]
            )
        )
    return out
