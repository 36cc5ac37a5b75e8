"""Disk-tier weights used in place on the CPU: views of the checkpoint's pages, mapped and unmapped per piece.

On the CPU a streamed weight needs no copy at all: a private, read-only-in-effect mapping
(``MAP_PRIVATE``) of the safetensors file gives a tensor over the page cache. The read-ahead thread
faults a piece's pages in (``MADV_POPULATE_READ``, which also reads them from disk when they are not
cached) while the piece before computes; after the piece ran its pages are unmapped (``MADV_DONTNEED``,
by the load that follows), so the process holds the bytes of the pieces in flight and no more. Under a
memory limit the pages are also dropped from the page cache, which is charged to the process.

Pages are mapped in 2 MiB folios, and two weights can share one. Each 2 MiB unit of a mapping is
therefore counted while some weight in it is in use, and only units no weight uses are unmapped, whole:
unmapping part of a folio would split its mapping and unmap its other part too, which the weight beside
it (the next piece's, or a resident's) would then fault back in 4 KiB at a time.

A ``MAP_PRIVATE`` mapping never writes to the file: the checkpoint is never modified.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxoffload_hf.safetensors_io import CheckpointError, TensorSlice, check_unchanged

_MADV_RANDOM = 1
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels get MADV_WILLNEED (asynchronous read-ahead)
_MADV_WILLNEED = 3
_MADV_HUGEPAGE = 14
_PAGE = mmap.PAGESIZE
_UNIT_SHIFT = 21  # 2 MiB: the folio size that MADV_HUGEPAGE asks for
UNIT_BYTES = 1 << _UNIT_SHIFT

_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_madvise.restype = ctypes.c_int


# Some of ATen's CPU kernels take another path, with other rounding, for an operand not aligned to 16
# bytes: a matrix-vector product (a linear layer on one token), the grouped product of stacked experts.
# The allocator aligns eager's copy to 64 bytes, and a file offset keeps its alignment in a mapping (both
# are page-aligned), so a weight is computed with in place only where its offset is aligned to 16; else
# it is read into the (aligned) staging arena, at the cost of a copy. Rows looked up in a table, or a
# tile copied into its whole-shaped buffer, are copied anyway: they are mapped at any offset.
_COMPUTE_ALIGN = 16


def can_map(source: TensorSlice, dtype: torch.dtype, *, compute: bool = True) -> bool:
    """Whether a weight can be used straight from its file: same dtype, aligned for its element size,
    and, where ops ``compute`` with the mapped pages themselves, to 16 bytes."""
    if source.dtype != dtype or source.nbytes == 0 or source.offset % dtype.itemsize:
        return False
    return not compute or source.offset % _COMPUTE_ALIGN == 0


def ask_for_2mib_folios(address: int, length: int) -> bool:
    """Ask that the ``length`` bytes of a file mapped at ``address`` come in 2 MiB folios: read from disk
    in large units, mapped and unmapped a page table at a time (about twenty times less work per piece
    than 4 KiB pages); whether the kernel took the hint (it is ignored where unsupported)."""
    if _madvise(address, length, _MADV_HUGEPAGE) != 0:
        return False
    # and a fault reads its 2 MiB folio, no more: without this it also reads the next 2 MiB, and a plain
    # fault up to the device's read-ahead (8 MiB seen) around it, pages of other weights that nothing
    # holds or drops (under a memory limit: charged, and read again when used)
    _madvise(address, length, _MADV_RANDOM)
    return True


def populate(address: int, length: int) -> bool:
    """Map the pages of ``length`` bytes at ``address`` in, reading them if need be (blocks); whether the
    kernel could (Linux 5.14+)."""
    return _madvise(address, length, _MADV_POPULATE_READ) == 0


@dataclass
class _Mapping:
    fd: int
    view: torch.Tensor  # uint8 over the whole file
    inode: int
    views: dict[TensorSlice, torch.Tensor] = field(default_factory=dict)  # made once per tensor


@dataclass(eq=False)
class MappedGroup:
    """Views of some tensors of the checkpoint, prepared once to be mapped and unmapped together often."""

    views: list[torch.Tensor]
    files: list[tuple[Path, list[TensorSlice], _Mapping]]  # each file with its tensors, as mapped
    units: list[tuple[int, int]]  # each view's 2 MiB units (a unit twice if two views touch it)
    fault_ranges: list[tuple[int, int]]  # the pages to fault in ahead
    ends: dict[int, int]  # mapping start -> end


class MappedFiles:
    """One private mapping per checkpoint file, shared by all pieces; thread-safe."""

    def __init__(self) -> None:
        self._maps: dict[Path, _Mapping] = {}
        self._lock = threading.Lock()
        self._populate = _MADV_POPULATE_READ
        self._held: Counter[tuple[int, int]] = Counter()  # (mapping start, 2 MiB unit) -> weights using it
        # the units each view touches, and the bytes of in-place weights per unit, for ``held_bytes``
        self._units: dict[TensorSlice, list[tuple[int, int]]] = {}
        self._fill: tuple[frozenset[TensorSlice], dict[tuple[int, int], int]] = (frozenset(), {})

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
                with _live_lock:
                    _live[mapping.view.data_ptr()] = (mapping.view.numel(), mapping.fd)
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
        ask_for_2mib_folios(view.data_ptr(), view.numel())
        return _Mapping(fd, view, inode)

    def group(self, sources: list[TensorSlice], fault_in: list[bool]) -> MappedGroup:
        """Views of ``sources`` prepared for ``acquire`` and ``release_groups``; ``fault_in`` says for each
        whether its pages are faulted in ahead (not for an embedding table whose lookups read a few rows).

        Raises:
            CheckpointError: as for ``view``.
        """
        views = self.views(sources)
        files = [(path, group, self._maps[path]) for path, group in _by_file(sources).items()]
        return MappedGroup(
            views=views,
            files=files,
            units=[unit for view in views for unit in _units(view)],
            fault_ranges=_page_ranges([view for view, fault in zip(views, fault_in, strict=True) if fault]),
            ends=_mapping_ends(views),
        )

    def is_current(self, group: MappedGroup) -> bool:
        """Whether ``group``'s views still map their files (False once a file was replaced: make it again).

        Raises:
            CheckpointError: as for ``check``.
        """
        for path, sources, mapping in group.files:
            stat = self._check(path, sources)
            if self._maps.get(path) is not mapping or mapping.inode != stat.st_ino:
                return False
        return True

    def acquire(self, group: MappedGroup) -> None:
        """Hold ``group``'s views and fault in their pages (blocks; releases the GIL)."""
        self._hold(group.units)
        self._fault(group.fault_ranges)

    def release_groups(self, groups: list[MappedGroup], drop_cache: bool) -> None:
        """End one ``acquire`` of each of ``groups``, as ``release`` does for tensors."""
        ends: dict[int, int] = {}
        for group in groups:
            ends.update(group.ends)
        self._release([unit for group in groups for unit in group.units], ends, drop_cache)

    def read_ahead(self, group: MappedGroup) -> None:
        """Ask the kernel to read ``group``'s pages into the page cache in the background (nothing is
        mapped or held: the pages fault in cheaply when ``acquire`` comes)."""
        for start, length in group.fault_ranges:
            _madvise(start, length, _MADV_WILLNEED)

    def populate(self, tensors: list[torch.Tensor]) -> None:
        """Hold ``tensors`` and fault their pages in, reading them from disk if needed (blocks; releases
        the GIL)."""
        self._hold([unit for tensor in tensors for unit in _units(tensor)])
        self._fault(_page_ranges(tensors))

    def release(self, tensors: list[torch.Tensor], drop_cache: bool) -> None:
        """End one hold of each of ``tensors``: unmap the 2 MiB units no held tensor uses any more (they
        fault back in from the file if used again); with ``drop_cache``, drop them from the page cache too."""
        self._release(
            [unit for tensor in tensors for unit in _units(tensor)], _mapping_ends(tensors), drop_cache
        )

    def _hold(self, units: list[tuple[int, int]]) -> None:
        with self._lock:
            self._held.update(units)

    def _fault(self, ranges: list[tuple[int, int]]) -> None:
        for start, length in ranges:
            if _madvise(start, length, self._populate) != 0:
                if ctypes.get_errno() != 22 or self._populate != _MADV_POPULATE_READ:
                    raise OSError(ctypes.get_errno(), "madvise failed while reading weights")
                self._populate = _MADV_WILLNEED  # kernel before 5.14
                _madvise(start, length, self._populate)

    def _release(self, units: list[tuple[int, int]], ends: dict[int, int], drop_cache: bool) -> None:
        unused: list[tuple[int, int]] = []
        held = self._held
        with self._lock:
            for unit in units:
                count = held[unit] - 1
                if count > 0:
                    held[unit] = count
                else:
                    del held[unit]
                    unused.append(unit)
            fds = {start: _fd_at(start) for start, _ in unused} if drop_cache else {}
        for start, address, length in _unit_ranges(unused, ends):
            _madvise(address, length, _MADV_DONTNEED)
            fd = fds.get(start)
            if fd is not None:
                os.posix_fadvise(fd, address - start, length, os.POSIX_FADV_DONTNEED)

    def units(self, source: TensorSlice) -> list[tuple[int, int]]:
        """The 2 MiB units of mapped address space ``source``'s view touches: each stays mapped whole
        while the view is held."""
        units = self._units.get(source)
        if units is None:
            units = self._units[source] = _units(self.view(source))
        return units

    def held_bytes(self, units: Iterable[tuple[int, int]], in_place: Collection[TensorSlice]) -> int:
        """What ``units`` can hold faulted in: per unit, the bytes of the weights used in place
        (``in_place``) that lie in it, at most the unit (a neighbour's pages, faulted in while the unit is
        held, stay mapped; the kernel maps 2 MiB folios whole)."""
        key = frozenset(in_place)  # the same object where ``in_place`` is one
        if key is not self._fill[0] and key != self._fill[0]:
            fill: dict[tuple[int, int], int] = {}
            for source in key:
                low = self.view(source).data_ptr()
                for unit in self.units(source):
                    index = unit[1]
                    overlap = min(low + source.nbytes, (index + 1) << _UNIT_SHIFT) - max(
                        low, index << _UNIT_SHIFT
                    )
                    fill[unit] = fill.get(unit, 0) + overlap
            self._fill = (key, fill)
        fill = self._fill[1]
        return sum(min(UNIT_BYTES, fill.get(unit, 0)) for unit in units)

    def _forget(self, path: Path) -> None:
        mapping = self._maps.pop(path)
        self._units = {source: units for source, units in self._units.items() if source.path != path}
        self._fill = (frozenset(), {})
        with _live_lock:
            _live.pop(mapping.view.data_ptr(), None)
        os.close(mapping.fd)  # the pages stay mapped until the last view of them is gone

    def close(self) -> None:
        with self._lock:
            for path in list(self._maps):
                self._forget(path)


# every open mapping of every store: its start -> (length, file descriptor); the file of a mapping's pages
# to drop from the cache, and ``file_position``
_live: dict[int, tuple[int, int]] = {}
_live_lock = threading.Lock()


def _fd_at(start: int) -> int | None:
    """The file descriptor of the open mapping starting at ``start``, if there is one."""
    with _live_lock:
        found = _live.get(start)
    return None if found is None else found[1]


def file_position(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The open file and byte offset ``tensor``'s first element lies at, when it is a view of a mapped
    checkpoint file (``MappedFiles``); else None. The descriptor stays open while its store is."""
    start = tensor.untyped_storage().data_ptr()
    with _live_lock:
        found = _live.get(start)
    if found is None:
        return None
    length, fd = found
    offset = tensor.data_ptr() - start
    return (fd, offset) if 0 <= offset < length else None


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


def _mapping_start(tensor: torch.Tensor) -> int:
    """Where the mapping that ``tensor`` views starts (its storage is the whole mapping)."""
    return tensor.untyped_storage().data_ptr()


def _mapping_ends(tensors: list[torch.Tensor]) -> dict[int, int]:
    """Start -> end of the mappings that ``tensors`` view."""
    return {_mapping_start(t): _mapping_start(t) + t.untyped_storage().nbytes() for t in tensors}


def _units(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """The 2 MiB units of address space (with the start of their mapping) that ``tensor``'s bytes touch."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return []
    start = _mapping_start(tensor)
    first = tensor.data_ptr() >> _UNIT_SHIFT
    last = (tensor.data_ptr() + nbytes - 1) >> _UNIT_SHIFT
    return [(start, unit) for unit in range(first, last + 1)]


def _unit_ranges(units: list[tuple[int, int]], ends: dict[int, int]) -> list[tuple[int, int, int]]:
    """(mapping start, address, length) ranges covering ``units``, merged where they follow each other and
    cut to their mapping's pages (``ends``: mapping start -> end)."""
    ranges: list[list[int]] = []
    for start, unit in sorted(units):
        low = max(unit << _UNIT_SHIFT, start)
        high = min((unit + 1) << _UNIT_SHIFT, (ends[start] + _PAGE - 1) // _PAGE * _PAGE)
        if ranges and ranges[-1][0] == start and ranges[-1][2] == low:
            ranges[-1][2] = high
        else:
            ranges.append([start, low, high])
    return [(start, low, high - low) for start, low, high in ranges]
