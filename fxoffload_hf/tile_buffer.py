"""Address space shaped like a whole weight, holding one tile of its rows at a time (``tiles``).

The buffer is a private anonymous mapping as large as the weight: pages never written read as the
kernel's shared zero page and take no memory. A tile's rows are not written into it directly (each write
would fault in and zero fresh pages, several times the cost of the copy): the range they cover is
overlaid with the pages of a small shared-memory file (``memfd``), made once and reused by every tile,
and put back to zero pages after the call. The file is emptied after the last tile of a call, so no
copy outlives it. A tile that is a view of its checkpoint file's pages needs no copy at all: those file
pages are mapped over its rows (``hold_file``), in a buffer whose tensor starts as far into a page as
the weight starts in its file.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading

import torch

_PAGE = mmap.PAGESIZE
_MAP_FIXED, _MAP_NORESERVE, _MAP_POPULATE = 0x10, 0x4000, 0x8000
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]


def _map(address: int | None, length: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    """``mmap`` at ``address`` (exactly there when given); raises ``OSError`` on failure."""
    got = _libc.mmap(address, length, _PROT, flags | (_MAP_FIXED if address is not None else 0), fd, offset)
    if got in (None, ctypes.c_void_p(-1).value) or (address is not None and got != address):
        err = ctypes.get_errno()
        raise OSError(err, f"cannot map a tile buffer: {os.strerror(err)}")
    return int(got)


def _round_up(size: int) -> int:
    return -(-size // _PAGE) * _PAGE


class WholeShapedBuffer:
    """A tensor of a whole weight's shape and dtype whose rows read as zeros except those of the tile
    put in with ``hold`` (copied in by the caller) or ``hold_file`` (its file's pages mapped there). The
    tensor starts ``shift`` bytes into its first page, so that a weight whose data starts that far into a
    page of its file lies page for page over the file. One tile at a time: callers hold ``lock``."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, shift: int = 0) -> None:
        size = math.prod(shape) * dtype.itemsize
        self.row_bytes = size // shape[0]
        self.shift = shift
        self.size = _round_up(shift + size)
        self.base = _map(None, self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        raw = (ctypes.c_char * self.size).from_address(self.base)
        self.tensor = torch.frombuffer(raw, dtype=torch.uint8)[shift : shift + size].view(dtype).view(shape)
        self.slot = os.memfd_create("fxoffload-tile", os.MFD_CLOEXEC)
        self.slot_bytes = 0
        self.lock = threading.Lock()

    def hold(self, start: int, stop: int) -> tuple[int, int]:
        """Back rows ``start:stop`` (and the rest of their edge pages) with the slot's pages; returns the
        byte range to ``release``."""
        first = (self.shift + start * self.row_bytes) // _PAGE * _PAGE
        length = _round_up(self.shift + stop * self.row_bytes) - first
        if length > self.slot_bytes:
            os.ftruncate(self.slot, length)
            self.slot_bytes = length
        _map(self.base + first, length, mmap.MAP_SHARED | _MAP_POPULATE, self.slot)
        return first, length

    def hold_file(self, start: int, stop: int, fd: int, offset: int) -> tuple[int, int]:
        """Map rows ``start:stop`` from file ``fd``, where row ``start`` lies at byte ``offset``, with no
        copy (the file pages around them land on neighbouring rows: a projection's rows do not touch
        each other's outputs); returns the byte range to ``release``. Needs ``offset`` to lie ``shift``
        bytes into a page, and ``start``'s rows to fill whole pages. Not populated: the loader has read
        the pages ahead, and the projection faults them in from the page cache several at a time
        (populating them one by one took longer than copying the tile)."""
        first = self.shift + start * self.row_bytes - offset % _PAGE
        assert first % _PAGE == 0, "a tile's rows must lie page for page over their file"
        length = _round_up(self.shift + stop * self.row_bytes) - first
        _map(self.base + first, length, mmap.MAP_PRIVATE, fd, offset - offset % _PAGE)
        return first, length

    def release(self, first: int, length: int, last: bool) -> None:
        """Put zero pages back over a held range; after the last tile of a call, free the slot's pages."""
        _map(self.base + first, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        if last:
            os.ftruncate(self.slot, 0)
            self.slot_bytes = 0


_buffers: dict[tuple[tuple[int, ...], torch.dtype, int], WholeShapedBuffer] = {}
_buffers_lock = threading.Lock()


def whole_shaped(shape: tuple[int, ...], dtype: torch.dtype, shift: int = 0) -> WholeShapedBuffer:
    """The process's buffer for weights of ``shape`` and ``dtype`` starting ``shift`` bytes into a page
    (made once: it takes address space, not memory)."""
    with _buffers_lock:
        key = (shape, dtype, shift)
        if key not in _buffers:
            _buffers[key] = WholeShapedBuffer(shape, dtype, shift)
        return _buffers[key]
