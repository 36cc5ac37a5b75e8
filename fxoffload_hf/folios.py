"""Whether a checkpoint's cached pages lie in 2 MiB folios, as the engine's own reads leave them.

After ``from_pretrained`` Transformers has read every tensor once to index it; the pages it read sit in
the page cache in small folios, each 4 KiB page mapped and unmapped on its own, about twenty times the
work per piece of a 2 MiB folio (measured on the cold-start model: its steady eager ``generate`` took
1.3-1.5 s on such pages against 0.94-1.1 s on 2 MiB folios). Such files are dropped from the page cache
so that the engine reads them again in 2 MiB folios (``mapped_io``). A file whose pages are cached in 2
MiB folios already (an earlier process's engine read them) is kept: dropping it made a second process's
first ``generate`` read the whole checkpoint from disk again (0.4 s more on that model, from 0.98 s).

A file counts as in 2 MiB folios where most of a few of its 2 MiB units spread over it, of those
resident, map as 2 MiB pages when populated in a private mapping asking for huge pages (the kernel's
``FilePmdMapped`` grows by their size; an embedding table's rows read by lookups stay in small folios
whoever reads them, so not all need to). Anything else (too few units resident, a file whose residency
the kernel does not tell this process, a kernel without the count, a mapping not 2 MiB aligned) counts as
small folios: the file is dropped, as it always was before this check.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

from fxoffload_hf.mapped_io import UNIT_BYTES, ask_for_2mib_folios, populate
from fxoffload_hf.safetensors_io import drop_cached_pages

_SAMPLES = 8  # 2 MiB units looked at per file, evenly spread (its first, which holds the header, not)
_LARGE_SHARE = 0.75  # of those resident, how many must map whole
_ROLLUP = Path("/proc/self/smaps_rollup")
_mincore = ctypes.CDLL(None, use_errno=True).mincore
_mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_mincore.restype = ctypes.c_int


def drop_small_folios(paths: list[Path]) -> list[Path]:
    """Drop from the page cache each of ``paths`` whose cached pages are not in 2 MiB folios; the paths
    dropped."""
    dropped = [path for path in paths if not in_large_folios(path)]
    drop_cached_pages(dropped)
    return dropped


def in_large_folios(path: Path) -> bool:
    """Whether ``path``'s sampled 2 MiB units are resident and map as 2 MiB pages (see the module
    docstring); False wherever that cannot be told."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        stat = os.fstat(fd)
        if stat.st_size < (_SAMPLES + 1) * UNIT_BYTES:
            return False  # a small file: read again at little cost
        if not _residency_told(path, stat):
            return False
        region = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        os.close(fd)
        return False
    try:
        return _units_map_whole(region)
    finally:
        region.close()
        os.close(fd)


def _units_map_whole(region: mmap.mmap) -> bool:
    view = torch.frombuffer(region, dtype=torch.uint8)
    try:
        base, size = view.data_ptr(), view.numel()
        if base % UNIT_BYTES or not ask_for_2mib_folios(base, size):
            return False
        whole_units = size // UNIT_BYTES
        picked = {1 + i * (whole_units - 1) // _SAMPLES for i in range(_SAMPLES)}
        # a unit not resident is not populated: that would read it, in a 2 MiB folio whatever the rest is in
        units = [base + i * UNIT_BYTES for i in sorted(picked) if i < whole_units]
        resident = [unit for unit in units if _resident(unit)]
        if len(resident) < _SAMPLES // 2:
            return False
        before = _file_pmd_mapped()
        if before is None or not all(populate(unit, UNIT_BYTES) for unit in resident):
            return False
        after = _file_pmd_mapped()
        return after is not None and after - before >= _LARGE_SHARE * len(resident) * UNIT_BYTES
    finally:
        del view


def _residency_told(path: Path, stat: os.stat_result) -> bool:
    """Whether ``mincore`` tells this process which pages of ``path`` are cached: since Linux 5.2 only to
    its owner, a writer or a privileged process; to others it says every page is."""
    return os.geteuid() in (0, stat.st_uid) or os.access(path, os.W_OK)


def _resident(address: int) -> bool:
    """Whether every page of the 2 MiB unit at ``address`` is in the page cache."""
    pages = UNIT_BYTES // mmap.PAGESIZE
    vector = (ctypes.c_ubyte * pages)()
    if _mincore(address, UNIT_BYTES, vector) != 0:
        return False
    return all(byte & 1 for byte in vector)


def _file_pmd_mapped() -> int | None:
    """This process's file pages mapped as 2 MiB pages, in bytes (None where the kernel does not say)."""
    try:
        text = _ROLLUP.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("FilePmdMapped:"):
            return int(line.split()[1]) * 1024
    return None
