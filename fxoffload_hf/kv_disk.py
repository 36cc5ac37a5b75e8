"""KV cache storage on disk: a tensor in a file of its own, mapped shared, whose pages can be sent back.

When ``generate``'s KV cache cannot fit the budget, each layer's keys and values are reserved
(``reserved_cache``) in files instead of RAM: ``DiskTensor`` is an unlinked file in the offload folder,
its space reserved up front (``posix_fallocate``: a full disk is an error now, not a ``SIGBUS`` later),
mapped ``MAP_SHARED`` and seen as a tensor. A layer's attention reads its cache through the mapping, so
it computes with the same values in the same layout (bit-exact); after it, ``page_out`` (an operator,
so that a captured graph keeps the call where the traced code made it) unmaps the layer's pages
(``MADV_DONTNEED``: the data stays in the file) and asks the kernel to write them back and drop them
from the page cache (``POSIX_FADV_DONTNEED``: writeback starts at once; pages still being written are
dropped at the layer's next release). So about two layers of the cache are in memory at a time.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from fxoffload_hf.memory_model import format_bytes

_MEMORY_FILESYSTEMS = {"tmpfs", "ramfs"}
# the live stores by the address of their storage: what ``page_out`` and the budget's count look up
_STORES: weakref.WeakValueDictionary[int, DiskTensor] = weakref.WeakValueDictionary()


class DiskTensor:
    """A tensor of ``shape`` and ``dtype`` whose bytes are an unlinked file in ``folder``, mapped shared."""

    def __init__(self, folder: Path, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        count = math.prod(shape)
        size = max(mmap.PAGESIZE, -(-count * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE)
        # unlinked from the start (nothing is left if the process dies); closed once the tensor is gone
        self._file = tempfile.TemporaryFile(dir=folder, prefix="fxoffload-kv-")  # noqa: SIM115
        try:
            os.posix_fallocate(self._file.fileno(), 0, size)
            self._map = mmap.mmap(self._file.fileno(), size, mmap.MAP_SHARED)
        except OSError as exc:
            self._file.close()
            raise OSError(
                exc.errno,
                f"cannot reserve {format_bytes(size)} for the KV cache in {folder}: "
                f"{exc.strerror}; free space there or pass another offload_folder",
            ) from exc
        weakref.finalize(self, self._file.close)  # the mapping lives on while a tensor holds it
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=count).view(shape)
        _STORES[self.tensor.untyped_storage().data_ptr()] = self

    def page_out(self) -> None:
        """Unmap the tensor's pages and have them written back and dropped from the page cache."""
        self._map.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def on_disk(tensor: Any) -> bool:
    """Whether ``tensor`` is a view of a live ``DiskTensor``."""
    if not _STORES or not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    try:
        return tensor.untyped_storage().data_ptr() in _STORES
    except RuntimeError:  # a fake tensor has no data
        return False


@torch.library.custom_op("fxoffload_hf::page_out", mutates_args=("store",))
def page_out(store: torch.Tensor) -> None:
    """Send ``store``'s pages back to its file (a ``DiskTensor``; anything else is left alone)."""
    disk = _STORES.get(store.untyped_storage().data_ptr()) if store.device.type == "cpu" else None
    if disk is not None:
        disk.page_out()


@page_out.register_fake
def _page_out_fake(store: torch.Tensor) -> None:
    return None


def resident_bytes(stores: list[torch.Tensor]) -> int:
    """What a cache whose layers' keys and values are ``stores`` (on disk) holds in memory at most: the
    layer being read and the one before it, not yet paged out: two pairs of the largest store."""
    sizes = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in stores}
    return min(sum(sizes.values()), 4 * max(sizes.values(), default=0))


def paged_out_bytes(tensors: Iterable[Any]) -> int:
    """Of the bytes ``tensors`` take at their sizes, those of the ones kept on disk, less the part of them
    in memory at a time (``resident_bytes``): what a count of the tensors as held whole overstates."""
    stores = [t for t in tensors if on_disk(t)]
    return sum(t.numel() * t.element_size() for t in stores) - resident_bytes(stores) if stores else 0


def memory_filesystem(folder: Path) -> str | None:
    """The type of the filesystem holding ``folder`` where it keeps files in memory (tmpfs), else None."""
    path = os.path.realpath(folder)
    best, kind = "", None
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) > len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind if kind in _MEMORY_FILESYSTEMS else None


def cache_folder(configured: Path | None) -> Path:
    """Where a KV cache that cannot fit goes: ``offload_folder``, else the temporary folder; refused
    where that is kept in memory (a tmpfs), since the cache would then take the memory it must not."""
    folder = Path(configured) if configured is not None else Path(tempfile.gettempdir())
    kind = memory_filesystem(folder)
    if kind is not None:
        raise OSError(
            f"the KV cache does not fit the budget and would go to {folder}, which is a {kind} (kept in "
            "memory); pass offload_folder= on a disk"
        )
    folder.mkdir(parents=True, exist_ok=True)
    return folder
