"""One tile's share of a projection, computed bit for bit as the whole weight's product computes it.

Splitting a weight's rows keeps each output element's sum whole, but not always its rounding: a BLAS
picks how it splits the work by the shape of the call (MKL computes the tail of an odd number of rows
in a matrix-vector product apart), so ``linear(x, W[a:b])`` can differ from columns ``a:b`` of
``linear(x, W)`` in the last bit. ``tile_linear`` computes a tile with the whole weight's shape: its rows
in a buffer shaped like the whole weight whose other rows read as zeros and take no memory
(``tile_buffer``), the call made as eager makes it, the tile's columns kept. That costs the whole
projection's compute for each tile. So the first call of each shape also computes the tile's rows as a
product of their own and compares: where the two agree bit for bit, later calls of that shape compute
the tile alone (``tile_linear_alone``), a tile's share of the work. What decides the rounding is the
kernel the BLAS picks, fixed by shapes, strides, alignment and threads, not by the values: those are the
key, and a comparison over values that cannot tell two summation orders apart (mostly zeros) decides
nothing.

On CUDA a device buffer has no shared zero page: each tile is computed alone (``tile_linear_alone``).
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable, Hashable

import torch

from fxoffload_hf.mapped_io import file_position
from fxoffload_hf.tile_buffer import whole_shaped

_PAGE = mmap.PAGESIZE
# keys of the shapes whose tiles compute alone exactly (True) or not (False); the oldest let go past this
# many (a new prompt length is a new key: the verdicts of a long job's many shapes are cheap to learn
# again): room for the tiles of 64 weights cut in ``tiles.MOST_GRAPH_TILES`` (a few hundred bytes each), so that
# a call does not lose its own verdicts as it runs (cleared whole, a call with more tiles than this did)
_MOST_VERDICTS = 16384
_verdicts: dict[Hashable, bool] = {}
_verdicts_lock = threading.Lock()


def _page_aligned_position(tile: torch.Tensor, shape: tuple[int, ...], start: int) -> tuple[int, int] | None:
    """The file and offset of ``tile``'s rows, where they can be mapped into a whole-shaped buffer with no
    copy: a contiguous view of its checkpoint file, its rows starting on a page boundary of the weight
    (tiles are cut in whole pages), the weight 16-byte aligned (as eager's, for ATen's kernels)."""
    position = file_position(tile) if tile.is_contiguous() else None
    if position is None:
        return None
    row_bytes = math.prod(shape[1:]) * tile.element_size()
    weight_start = position[1] - start * row_bytes
    if (start * row_bytes) % _PAGE or weight_start % 16:
        return None
    return position


def _kernel_key(
    x: torch.Tensor, tile: torch.Tensor, bias: torch.Tensor | None, start: int, rows: int
) -> Hashable:
    """What picks the BLAS kernels of a tile's product and of the whole weight's: shapes, strides, dtypes,
    alignment (64 bytes: the widest vector loads), the tile's place, the flag some ATen kernels read, the
    bias and the threads."""
    return (
        tuple(x.shape),
        x.stride(),
        x.dtype,
        x.data_ptr() % 64,
        tuple(tile.shape),
        tile.stride(),
        tile.dtype,
        tile.data_ptr() % 64,
        tile.requires_grad,
        None if bias is None else (bias.dtype, bias.stride(), bias.data_ptr() % 64),
        start,
        rows,
        torch.get_num_threads(),
    )


def alone_is_exact(
    x: torch.Tensor, tile: torch.Tensor, bias: torch.Tensor | None, start: int, rows: int
) -> bool | None:
    """Whether a tile's product of its own rows has been seen to equal the whole weight's columns for
    calls of this kernel key; None until a call has compared them."""
    return _verdicts.get(_kernel_key(x, tile, bias, start, rows))


def _learn(key: Hashable, x: torch.Tensor, alone: torch.Tensor, whole_columns: torch.Tensor) -> None:
    """Record whether the tile's own product equalled the whole's columns, where ``x`` can tell: at least
    half its values nonzero (sums of a few nonzero terms can round alike in any order)."""
    if 2 * int(torch.count_nonzero(x)) < x.numel():
        return
    with _verdicts_lock:
        if len(_verdicts) >= _MOST_VERDICTS:
            del _verdicts[next(iter(_verdicts))]
        _verdicts[key] = torch.equal(alone, whole_columns)


def _alone(x: torch.Tensor, tile: torch.Tensor, bias: torch.Tensor | None, start: int) -> torch.Tensor:
    """The tile's rows as a product of their own."""
    stop = start + tile.shape[0]
    return torch.nn.functional.linear(x, tile, None if bias is None else bias[start:stop])


def _whole_shaped_product(
    x: torch.Tensor, tile: torch.Tensor, bias: torch.Tensor | None, start: int, rows: int
) -> torch.Tensor:
    """``linear(x, W, bias)`` for a ``W`` of ``rows`` rows that holds ``tile`` from row ``start`` and
    zeros elsewhere: exact in the tile's columns."""
    shape = (rows, *tile.shape[1:])
    stop = start + tile.shape[0]
    in_file = _page_aligned_position(tile, shape, start)
    buffer = whole_shaped(shape, tile.dtype, 0 if in_file is None else in_file[1] % _PAGE)
    with buffer.lock:
        held = buffer.hold(start, stop) if in_file is None else buffer.hold_file(start, stop, *in_file)
        try:
            whole = buffer.tensor
            if in_file is None:
                whole[start:stop].copy_(tile)
            if tile.requires_grad:  # the flag picks some of ATen's kernels: see ``loaders.as_parameters``
                whole = whole.detach().requires_grad_()
            return torch.nn.functional.linear(x, whole, bias)
        finally:
            buffer.release(*held, last=stop == rows)


@torch.compiler.disable
def tile_linear(
    x: torch.Tensor,
    tile: torch.Tensor,
    bias: torch.Tensor | None,
    start: int,
    rows: int,
    filled: torch.Tensor | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``linear(x, W, bias)`` for a ``W`` of ``rows`` rows of which only ``tile`` (its rows from ``start``)
    is given: exact in the tile's columns. The first tile's call returns its whole output; each later
    one copies its columns into that output (``filled``) and returns it. ``dtype``: the product is of
    ``W.to(dtype)`` (a weight the model converts before its projection), the tile converted first."""
    tile = _converted(tile, dtype)
    key = _kernel_key(x, tile, bias, start, rows)
    verdict = _verdicts.get(key)
    if verdict:
        return tile_linear_alone(x, tile, bias, start, rows, filled)
    stop = start + tile.shape[0]
    out = _whole_shaped_product(x, tile, bias, start, rows)
    if filled is None:
        filled = out
    else:
        filled[..., start:stop] = out[..., start:stop]
        del out  # the tile's own product is compared within the activations the plan counts (one output more)
    if verdict is None:
        _learn(key, x, _alone(x, tile, bias, start), filled[..., start:stop])
    return filled


@torch.compiler.disable
def tile_linear_alone(
    x: torch.Tensor,
    tile: torch.Tensor,
    bias: torch.Tensor | None,
    start: int,
    rows: int,
    filled: torch.Tensor | None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """As ``tile_linear``, with the tile's rows as a product of their own (on CUDA; on the CPU where that
    was seen to be exact)."""
    out = _alone(x, _converted(tile, dtype), bias, start)
    if filled is None:
        filled = out.new_empty(*out.shape[:-1], rows)
    filled[..., start : start + tile.shape[0]] = out
    return filled


def _converted(tile: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tile`` as the model's conversion of its weight gives it (``W.to(dtype)``: a new tensor, whose
    ``requires_grad`` follows grad mode as eager's conversion's does)."""
    return tile if dtype is None or dtype == tile.dtype else tile.to(dtype)


TileOp = Callable[..., torch.Tensor]  # (x, tile, bias, start, rows, filled[, dtype]) -> filled
