"""A checkpoint's cached pages are dropped after loading unless they lie in 2 MiB folios already."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch

from fxoffload_hf import folios
from fxoffload_hf.mapped_io import UNIT_BYTES, ask_for_2mib_folios, populate
from fxoffload_hf.safetensors_io import drop_cached_pages

_SIZE = 24 * UNIT_BYTES


def _written(path: Path) -> Path:
    """A file written a page at a time: its pages are cached as written, in small folios (a kernel gives
    large writes large folios)."""
    data = os.urandom(_SIZE)
    with path.open("wb") as file:
        for start in range(0, _SIZE, mmap.PAGESIZE):
            file.write(data[start : start + mmap.PAGESIZE])
    os.sync()
    return path


def _read_as_the_engine_reads(path: Path) -> int:
    """Drop ``path``'s pages, then read it back through a mapping asking for 2 MiB folios (as
    ``mapped_io`` does); the bytes of it the kernel mapped as 2 MiB pages."""
    drop_cached_pages([path])
    with path.open("rb") as file:
        region = mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = torch.frombuffer(region, dtype=torch.uint8)
    base, size = view.data_ptr(), view.numel()
    before = folios._file_pmd_mapped() or 0
    assert ask_for_2mib_folios(base, size) and populate(base, size)
    mapped_whole = (folios._file_pmd_mapped() or 0) - before
    del view
    region.close()
    return mapped_whole


def test_pages_written_a_page_at_a_time_are_small_folios_and_dropped(tmp_path):
    path = _written(tmp_path / "w.bin")
    assert not folios.in_large_folios(path)
    assert folios.drop_small_folios([path]) == [path]


def test_pages_not_cached_or_a_small_file_count_as_small(tmp_path):
    path = _written(tmp_path / "w.bin")
    drop_cached_pages([path])
    assert not folios.in_large_folios(path)  # nothing resident to look at: nothing lost by a drop
    small = tmp_path / "small.bin"
    small.write_bytes(b"\0" * UNIT_BYTES)
    assert not folios.in_large_folios(small)
    assert not folios.in_large_folios(tmp_path / "absent.bin")


def test_pages_read_in_2_mib_folios_are_kept(tmp_path):
    path = _written(tmp_path / "w.bin")
    if _read_as_the_engine_reads(path) < _SIZE // 2:
        pytest.skip("this kernel or file system maps a file's pages in no 2 MiB folios")
    assert folios.in_large_folios(path)
    assert folios.drop_small_folios([path]) == []


def test_a_file_whose_residency_the_kernel_does_not_tell_counts_as_small(tmp_path, monkeypatch):
    """mincore says every page of a file is cached to a process that neither owns nor may write it (Linux
    5.2+): such a file cannot be looked at, and is dropped as before."""
    path = _written(tmp_path / "w.bin")
    if _read_as_the_engine_reads(path) < _SIZE // 2:
        pytest.skip("this kernel or file system maps a file's pages in no 2 MiB folios")
    assert folios.in_large_folios(path)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(path).st_uid + 1)  # not its owner, not root
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # nor a writer
    assert not folios.in_large_folios(path)
