"""Disk-tier weights used in place on the CPU: views of the checkpoint's pages, mapped and unmapped per piece.

On the CPU a streamed weight needs no copy at all: a private, read-only-in-effect mapping
(``MAP_PRIVATE``) of the safetensors file gives a tensor over the page cache. The read-ahead thread
faults a piece's pages in (``MADV_POPULATE_READ``, which also reads them from disk when they are not
cached) while the piece before computes; after the piece ran its pages are unmapped (``MADV_DONTNEED``,
by the load that follows), so the process holds the bytes of the pieces in flight and no more. Under a
memory limit the pages are also dropped from the page cache, which is charged to the process.

A ``MAP_PRIVATE`` mapping never writes to the file: the checkpoint is never modified.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxoffload_hf.safetensors_io import CheckpointError, TensorSlice, check_unchanged

_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels get MADV_WILLNEED (asynchronous read-ahead)
_MADV_WILLNEED = 3
_MADV_HUGEPAGE = 14
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


def can_map(source: TensorSlice, dtype: torch.dtype) -> bool:
    """Whether a weight can be used straight from its file: same dtype, aligned for its element size."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return source.dtype == dtype and source.offset % itemsize == 0 and source.nbytes > 0


@dataclass
class _Mapping:
    fd: int
    view: torch.Tensor  # uint8 over the whole file
    inode: int
    views: dict[TensorSlice, torch.Tensor] = field(default_factory=dict)  # made once per tensor


class MappedFiles:
    """One private mapping per checkpoint file, shared by all pieces; thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[Path, _Mapping] = {}
        self._lock = threading.Lock()
        self._populate = _MADV_POPULATE_READ

    def view(self, source: TensorSlice) -> torch.Tensor:
        """The tensor ``source`` describes, over the file's pages (not yet faulted in).

        Raises:
            CheckpointError: the file is gone, or changed so that the tensor no longer lies where it did.
        """
        return self.views([source])[0]

    def views(self, sources: list[TensorSlice]) -> list[torch.Tensor]:
        """``view`` for several tensors, each file checked once."""
        out: dict[TensorSlice, torch.Tensor] = {}
        for path, group in _by_file(sources).items():
            mapping = self._mapping(path, self._check(path, group))
            for source in group:
                view = mapping.views.get(source)
                if view is None:
                    raw = mapping.view[source.offset : source.offset + source.nbytes]
                    view = mapping.views[source] = raw.view(source.dtype).view(source.shape)
                out[source] = view
        return [out[source] for source in sources]

    def check(self, sources: list[TensorSlice]) -> None:
        """Raise if a file of ``sources`` is gone or changed so that its tensors no longer lie where they
        did. A file truncated under a mapping faults (SIGBUS) when the lost pages are touched: every use
        of a mapped weight is checked first.

        Raises:
            CheckpointError: as for ``check_unchanged``.
        """
        for path, group in _by_file(sources).items():
            self._check(path, group)

    @staticmethod
    def _check(path: Path, sources: list[TensorSlice]) -> os.stat_result:
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found; restore the missing shard") from None
        check_unchanged(path, sources, stat)
        return stat

    def _mapping(self, path: Path, stat: os.stat_result) -> _Mapping:
        with self._lock:
            mapping = self._maps.get(path)
            if mapping is not None and mapping.inode != stat.st_ino:
                self._forget(path)  # the file was replaced: map the new one
                mapping = None
            if mapping is None:
                mapping = self._open(path, stat.st_ino)
                self._maps[path] = mapping
            return mapping

    @staticmethod
    def _open(path: Path, inode: int) -> _Mapping:
        fd = os.open(path, os.O_RDONLY)
        try:
            region = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        # the tensor keeps the mapping alive for as long as any view of it exists
        view = torch.frombuffer(region, dtype=torch.uint8)
        # ask for 2 MiB folios: read from disk in large units, mapped and unmapped a page table at a time
        # (about twenty times less work per piece than 4 KiB pages); a hint, ignored where unsupported
        _madvise(view.data_ptr(), view.numel(), _MADV_HUGEPAGE)
        return _Mapping(fd, view, inode)

    def populate(self, tensors: list[torch.Tensor]) -> None:
        """Fault the pages of ``tensors`` in, reading them from disk if needed (blocks; releases the GIL)."""
        for start, length in _page_ranges(tensors):
            if _madvise(start, length, self._populate) != 0:
                if ctypes.get_errno() != 22 or self._populate != _MADV_POPULATE_READ:
                    raise OSError(ctypes.get_errno(), "madvise failed while reading weights")
                self._populate = _MADV_WILLNEED  # kernel before 5.14
                _madvise(start, length, self._populate)

    def release(self, tensors: list[torch.Tensor], sources: list[TensorSlice], drop_cache: bool) -> None:
        """Unmap the pages of ``tensors`` (they fault back in from the file if used again); with
        ``drop_cache``, drop them from the page cache too."""
        for start, length in _page_ranges(tensors):
            _madvise(start, length, _MADV_DONTNEED)
        if drop_cache:
            for source in sources:
                mapping = self._maps.get(source.path)
                if mapping is not None:
                    os.posix_fadvise(mapping.fd, source.offset, source.nbytes, os.POSIX_FADV_DONTNEED)

    def _forget(self, path: Path) -> None:
        mapping = self._maps.pop(path)
        os.close(mapping.fd)  # the pages stay mapped until the last view of them is gone

    def close(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self._forget(path)


def _by_file(sources: list[TensorSlice]) -> dict[Path, list[TensorSlice]]:
    groups: dict[Path, list[TensorSlice]] = {}
    for source in sources:
        groups.setdefault(source.path, []).append(source)
    return groups


def _page_ranges(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Page-aligned (start, length) ranges covering the tensors' bytes, merged where they touch.

    Not widened to whole 2 MiB folios: under a memory limit that unmaps and refaults the neighbours'
    pages, and measured slower (1.7-1.8 against 1.9 tokens/s in the benchmark), with no gain without one.
    """
    spans = sorted(
        (t.data_ptr() // _PAGE * _PAGE, t.data_ptr() + t.numel() * t.element_size())
        for t in tensors
        if t.numel()
    )
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]
