"""Eager calls of a projection whose weight is too large to lend whole: its rows lent a tile at a time.

A plain ``nn.Linear`` whose weight cannot be lent whole beside another module (an output head of a large
vocabulary under a small budget) would make every eager call refuse, and deferred capture (the default)
capture from the first call, where graphs' state may not fit either. Its eager call is computed as a
captured graph computes a tiled projection (``tiles``): rows ``a:b`` of the weight at a time, each with
``tile_linear`` (on the CPU bit for bit as the whole projection; on CUDA each tile alone, and only where
the weight cannot fit even alone, as in graphs). Each tile is lent as a stored weight is: mapped from its
file where it lies, else read; the next tile's pages are read ahead while one computes (where the page
cache keeps them: ``WeightStore.read_ahead``). Tiles are the store's (``WeightStore.add_tile``), so a
dtype change or a spill re-points them as it does a graph's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn

from fxoffload_hf.capture import handle_of
from fxoffload_hf.eager_ops import uncounted
from fxoffload_hf.eager_sizes import record_of
from fxoffload_hf.loaders import Way, way_of
from fxoffload_hf.mapped_io import MappedGroup
from fxoffload_hf.tiles import (
    ROW_GROUP,
    copied_to_compute,
    fewest_rows,
    rows_per_tile,
    tile_op,
    tile_ranges,
    too_large_for,
)
from fxoffload_hf.weight_record import WeightRecord
from fxoffload_hf.weights import WeightStore

# a tile takes at most this share of the room for weights (held twice on the CPU while it computes), as a
# graph's tiles do: the room left keeps other weights for eager calls
_TILE_SHARE = 4
# and an eager call cuts a weight into at most this many tiles: each tile's first call of a shape computes
# the whole projection too, to learn whether the tile alone rounds as it (``tile_products``); later calls
# compute alone. A call that needs smaller tiles is captured instead. (8 until tiles computed alone: a
# tied 32,000 x 256 table then needed 7.8 MiB lent, and such models were refused at a quarter of their
# weights, where capture's graphs' state does not fit either; 32 until 2026-12-07: a tied GPT-2 of that
# table needed 4.57 MiB lent at 10% of its weights, 4.13 MiB.) At most that many whole projections at a
# call of a new shape, where the cap binds: at budgets that tight, a call reads far more than it computes.
MOST_TILES = 64


class EagerTiling:
    """Which plain projections of a model eager calls compute in tiles of rows, and computing them: noted
    for a room for weights (``note``), in use once turned ``on``."""

    def __init__(self, names: Mapping[nn.Module, str], store: WeightStore) -> None:
        self.names = names
        self.store = store
        self.rows: dict[nn.Module, int] = {}  # per projection that can go in tiles, rows per tile
        self.described: list[str] = []  # each noted projection, named with its tiles
        self.on = False

    def note(self, room: int) -> None:
        """Note the plain projections whose weight is too large to lend beside another module's within
        ``room`` bytes for weights: their eager calls can be computed in tiles of rows."""
        self.rows.clear()
        described = []
        for module, name in self.names.items():
            weight = module._parameters.get("weight")
            handle = handle_of(weight)
            if weight is None or handle is None or not projects_by_rows(module):
                continue
            rows = rows_per_eager_tile(handle.record, room, weight.device.type)
            if rows is not None:
                self.rows[module] = rows
                described.append(f"{name} ({-(-handle.record.shape[0] // rows)} tiles of {rows} rows)")
        self.described = described

    @contextmanager
    def noted_for(self, room: int) -> Iterator[None]:
        """Within: the projections noted for ``room`` bytes for weights (``note``); as before after."""
        rows, described = dict(self.rows), self.described
        try:
            self.note(room)
            yield
        finally:
            self.rows, self.described = rows, described

    @contextmanager
    def used(self, on: bool) -> Iterator[None]:
        """Within: the noted projections in tiles (``on``) or whole; as before after."""
        was, self.on = self.on, on
        try:
            yield
        finally:
            self.on = was

    def in_tiles(self, module: nn.Module) -> bool:
        """Whether an eager call of ``module`` is computed in tiles now."""
        return self.on and module in self.rows

    def tiled(self, module: nn.Module, ghost: nn.Parameter) -> bool:
        """Whether ``ghost`` is ``module``'s weight computed in tiles now (not lent whole)."""
        return self.in_tiles(module) and module._parameters.get("weight") is ghost

    def held_bytes(self, module: nn.Module) -> int:
        """What a tile of ``module``'s weight holds while it computes; 0 where it is lent whole."""
        rows = self.rows.get(module) if self.on else None
        weight = module._parameters.get("weight")
        if rows is None or weight is None:
            return 0
        return tile_bytes(record_of(weight), rows, weight.device.type)

    def project(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The eager call of a projection computed in tiles; its bias is lent."""
        weight, bias = module._parameters["weight"], module._parameters.get("bias")
        assert weight is not None
        with uncounted():  # one node in a captured graph (counted as the module's own call)
            return project_in_tiles(x, weight, bias, self.store, self.rows[module])


def projects_by_rows(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Linear`` (its own forward) of a 2-D weight: its eager call can
    be computed in tiles of the weight's rows."""
    weight = module._parameters.get("weight")
    return type(module).forward is nn.Linear.forward and weight is not None and weight.dim() == 2


def rows_per_eager_tile(record: WeightRecord, room: int, device_type: str) -> int | None:
    """Rows per tile for eager calls of a projection by ``record`` within ``room`` bytes for weights; None
    where the weight is lent whole (it fits beside another module's, or cannot stream)."""
    if not record.tier.streams:
        return None
    return tile_rows_for(record.shape, record.dtype.itemsize, record.footprint, room, device_type)


def tile_rows_for(
    shape: tuple[int, ...], itemsize: int, footprint: int, room: int, device_type: str
) -> int | None:
    """As ``rows_per_eager_tile``, for a weight of ``shape`` and ``itemsize`` that takes ``footprint``
    bytes whole (``plan`` asks without a store)."""
    if footprint <= too_large_for(room, device_type):
        return None
    group = math.lcm(fewest_rows(shape, itemsize), ROW_GROUP)
    # whole pages and row groups, MOST_TILES tiles at most
    fewest = -(-shape[0] // MOST_TILES // group) * group
    rows = max(rows_per_tile(shape, itemsize, room // _TILE_SHARE), fewest)
    return rows if rows < shape[0] else None


def tile_bytes(record: WeightRecord, rows: int, device_type: str) -> int:
    """What one tile of ``rows`` rows of ``record`` holds while it computes: its share of the weight's
    footprint (a converted copy with it), and its copy in the whole-shaped buffer on the CPU."""
    return tile_held(record.shape, record.dtype.itemsize, record.footprint, rows, device_type)


def tile_held(shape: tuple[int, ...], itemsize: int, footprint: int, rows: int, device_type: str) -> int:
    """As ``tile_bytes``, for a weight of ``shape`` and ``itemsize`` that takes ``footprint`` bytes whole."""
    copy = rows * math.prod(shape[1:]) * itemsize if copied_to_compute(device_type) else 0
    return -(-footprint * rows // shape[0]) + copy


def project_in_tiles(
    x: torch.Tensor, weight: nn.Parameter, bias: torch.Tensor | None, store: WeightStore, rows: int
) -> torch.Tensor:
    """``linear(x, W, bias)`` for the stored weight ``W`` that ghost ``weight`` stands for, ``rows`` rows
    at a time."""
    handle = handle_of(weight)
    assert handle is not None, "a tiled projection's weight is a ghost"
    record, device = handle.record, weight.device
    copied, op = copied_to_compute(device.type), tile_op(device.type)
    tiles = [store.add_tile(record.name, a, b, copied=copied) for a, b in tile_ranges(record.shape[0], rows)]
    filled: torch.Tensor | None = None
    for i, tile in enumerate(tiles):
        with _lent(store, tile, weight, tiles[i + 1] if i + 1 < len(tiles) else None) as value:
            filled = op(x, value, bias, tile.tile_rows[0], record.shape[0], filled)
    assert filled is not None
    return filled


@contextmanager
def _lent(
    store: WeightStore, tile: WeightRecord, ghost: nn.Parameter, following: WeightRecord | None
) -> Iterator[torch.Tensor]:
    """``tile``'s values for one tile's call: a view of its file's pages where they serve as they lie,
    else read (and converted to the ghost's dtype); ``following``'s pages read ahead meanwhile."""
    group = _mapped_group(store, tile, ghost)
    ahead = _mapped_group(store, following, ghost) if following is not None else None
    if group is None:
        if ahead is not None:
            store.read_ahead(ahead)
        value = store.read(tile).to(ghost.device, ghost.dtype)
    else:
        store.files.acquire(group)
        if ahead is not None:
            store.read_ahead(ahead)
        value = group.views[0]
    if tile.requires_grad and not torch.is_grad_enabled():  # as ``EagerWeights.before`` lends weights
        value = value.detach().requires_grad_()
    try:
        yield value
    finally:
        if group is not None:
            store.files.release_groups([group], store.drop_cache)


def _mapped_group(store: WeightStore, tile: WeightRecord, ghost: nn.Parameter) -> MappedGroup | None:
    """A mapped group of ``tile``'s file pages where they serve the compute as they lie; else None."""
    if tile.disk is None or ghost.dtype != tile.dtype or way_of(tile, ghost.device.type) is not Way.MAPPED:
        return None
    return store.files.group([tile.disk], [True])
