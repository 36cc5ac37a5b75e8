"""Disk-tier weights used in place on the CPU: mapped views, faulting in, unmapping, changed files."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import fxoffload_hf
from fxoffload_hf import mapped_io
from fxoffload_hf.mapped_io import MappedFiles, _page_ranges, can_map
from fxoffload_hf.memory import process_status
from fxoffload_hf.safetensors_io import CheckpointError, read_header
from fxoffload_hf.weight_record import Tier

MiB = 2**20


def _rss_file() -> int:
    return process_status()["RssFile"]


@pytest.fixture
def shard(tmp_path):
    tensors = {
        "big": torch.randn(8 * MiB // 4),  # 8 MiB of fp32
        "small": torch.randn(3, 5),
        "half": torch.randn(7, 9).to(torch.bfloat16),
    }
    path = tmp_path / "a.safetensors"
    save_file(tensors, path)
    return path, tensors


def test_views_equal_the_saved_tensors_and_survive_release(shard):
    path, tensors = shard
    files = MappedFiles()
    slices = read_header(path)
    views = {k: files.view(s) for k, s in slices.items()}
    files.populate(list(views.values()))
    for key, view in views.items():
        assert torch.equal(view, tensors[key])
    files.release(list(views.values()), drop_cache=True)
    for key, view in views.items():  # unmapped pages fault back in from the file
        assert torch.equal(view, tensors[key])
    files.close()


def test_release_returns_the_mapped_pages(shard):
    path, _ = shard
    files = MappedFiles()
    source = read_header(path)["big"]
    view = files.view(source)
    before = _rss_file()
    files.populate([view])
    mapped = _rss_file()
    assert mapped - before >= 7 * MiB, (before, mapped)
    files.release([view], drop_cache=False)
    assert _rss_file() - before < 3 * MiB
    files.close()


def test_pages_shared_with_a_weight_in_use_stay_mapped(tmp_path, monkeypatch):
    # weights of 1, 3 and 3 MiB side by side: the last two share a 2 MiB folio (and a page). Unmapping the
    # middle one must not unmap any page of its neighbours, nor part of a folio (that splits its mapping)
    path = tmp_path / "three.safetensors"
    save_file({name: torch.randn(mib * MiB // 4) for name, mib in (("a", 1), ("b", 3), ("c", 3))}, path)
    expected = load_file(path)
    slices = read_header(path)
    files = MappedFiles()
    a, b, c = (files.view(slices[name]) for name in "abc")
    unmapped: list[tuple[int, int]] = []
    madvise = mapped_io._madvise

    def spy(start, length, advice):
        if advice == mapped_io._MADV_DONTNEED:
            unmapped.append((start, start + (length + 4095) // 4096 * 4096))
        return madvise(start, length, advice)

    monkeypatch.setattr(mapped_io, "_madvise", spy)
    files.populate([a, b, c])
    files.release([b], drop_cache=False)
    assert unmapped, "nothing of the released weight was unmapped"
    for other in (a, c):
        low, high = other.data_ptr(), other.data_ptr() + other.numel() * 4
        assert all(end <= low or start >= high for start, end in unmapped), (
            "a neighbour's pages were unmapped"
        )
    mapping_start = b.untyped_storage().data_ptr()
    assert all((start - mapping_start) % (2 * MiB) == 0 for start, _ in unmapped), "part of a folio unmapped"
    before = _rss_file()
    files.release([a, c], drop_cache=False)
    assert before - _rss_file() >= 3 * MiB, "the last release left pages mapped"
    for name, view in zip("abc", (a, b, c), strict=True):  # unmapped pages fault back in from the file
        assert torch.equal(view, expected[name])
    files.close()


def _cached_bytes(path, offset: int, length: int) -> int:
    """Bytes of ``path``'s pages in ``[offset, offset + length)`` that the page cache holds (mincore)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, flags=mmap.MAP_PRIVATE) as region:
        base = torch.frombuffer(region, dtype=torch.uint8).data_ptr()
        start, end = offset // mmap.PAGESIZE, -(-(offset + length) // mmap.PAGESIZE)
        pages = (ctypes.c_ubyte * (end - start))()
        assert libc.mincore(base + start * mmap.PAGESIZE, (end - start) * mmap.PAGESIZE, pages) == 0
        return sum(p & 1 for p in pages) * mmap.PAGESIZE


def test_a_fault_reads_no_pages_beyond_the_weight_it_serves(tmp_path):
    # the kernel would read around a faulted page (up to the device's read-ahead, megabytes), pages of
    # the weights after it that nothing holds or drops: faults read their own folio and no more
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(MiB // 4), "b": torch.randn(15 * MiB // 4)}, path)
    header = read_header(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    b = header["b"]
    assert _cached_bytes(path, b.offset, b.nbytes) == 0, "the page cache did not let the file go"
    files = MappedFiles()
    group = files.group([header["a"]], [True])
    files.acquire(group)
    try:
        # what a's 2 MiB folio covers of b at most (the kernel reads whole folios)
        assert _cached_bytes(path, b.offset, b.nbytes) <= 2 * MiB
    finally:
        files.release_groups([group], drop_cache=True)
        files.close()


def test_writes_through_a_view_never_reach_the_file(shard):
    path, tensors = shard
    original = path.read_bytes()
    files = MappedFiles()
    view = files.view(read_header(path)["small"])
    view.add_(1.0)  # a private mapping: copy-on-write, never written back
    assert path.read_bytes() == original
    files.close()


def test_a_truncated_file_is_an_error_not_a_crash(shard):
    path, _ = shard
    files = MappedFiles()
    source = read_header(path)["big"]
    files.populate([files.view(source)])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # same inode, shorter: touching the lost pages would SIGBUS
    with pytest.raises(CheckpointError, match="a.safetensors"):
        files.view(source)
    with pytest.raises(CheckpointError, match="a.safetensors"):
        files.check([source])
    files.close()


def test_a_missing_file_is_named(shard):
    path, _ = shard
    files = MappedFiles()
    source = read_header(path)["small"]
    path.unlink()
    with pytest.raises(CheckpointError, match="a.safetensors.*not found"):
        files.view(source)


def test_a_replaced_file_with_the_same_layout_is_mapped_afresh(shard, tmp_path):
    path, tensors = shard
    files = MappedFiles()
    source = read_header(path)["small"]
    assert torch.equal(files.view(source), tensors["small"])
    changed = {k: v + 1 if k == "small" else v for k, v in tensors.items()}
    time.sleep(0.01)
    save_file(changed, tmp_path / "new.safetensors")
    os.replace(tmp_path / "new.safetensors", path)  # a new inode at the same path
    assert torch.equal(files.view(source), load_file(path)["small"])
    files.close()


def test_page_ranges_are_aligned_and_merged():
    buffer = torch.empty(5 * 4096, dtype=torch.uint8)
    base = buffer.data_ptr()
    a, b, c = buffer[100:5000], buffer[5000:9000], buffer[4 * 4096 + 8 : 4 * 4096 + 16]
    ranges = _page_ranges([c, a, b])
    assert all(start % 4096 == 0 for start, _ in ranges)
    covered = [(s, s + n) for s, n in ranges]
    for t in (a, b, c):
        assert any(s <= t.data_ptr() and t.data_ptr() + t.numel() <= e for s, e in covered)
    assert len(ranges) == 2  # a and b touch; c is pages away
    assert ranges[0][0] <= base + 100


def test_only_same_dtype_aligned_tensors_are_used_in_place(shard):
    path, _ = shard
    big = read_header(path)["big"]
    assert not can_map(big, torch.bfloat16)  # converted as it streams: staged instead
    # ops compute with mapped pages at offsets aligned to 16 bytes (as eager's copies are, for ATen's
    # kernels that round by alignment); rows and tiles are copied out of them at any element offset
    for offset, computed in [(4096, True), (48, True), (8, False), (4, False)]:
        moved = dataclasses.replace(big, offset=offset)
        assert can_map(moved, torch.float32) is computed
        assert can_map(moved, torch.float32, compute=False)
    assert not can_map(dataclasses.replace(big, offset=6), torch.float32, compute=False)


def test_cpu_streaming_uses_no_staging_copy_and_keeps_residents_mapped(tmp_path, place_data_at):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    eager = tf.LlamaForCausalLM(cfg).eval()
    eager.save_pretrained(tmp_path / "ckpt")
    place_data_at(tmp_path / "ckpt", 0)  # where ops compute with the mapped pages
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = eager(ids).logits
    total = sum(p.numel() * 4 for p in eager.parameters())
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", cpu_memory=int(total * 0.6), device="cpu")
    try:
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(ids).logits, expected)
        engine = fxoffload_hf.engine_of(model)
        store = engine.store
        assert engine.loader.arena.capacity == 0  # every streamed weight is a view of its file
        assert store.bytes_in(Tier.DISK) > 0
        kept = [r for r in store.records.values() if r.tier is Tier.MAPPED]
        assert kept, "the schedule kept no weight resident"
        for record in kept:  # its file's pages, no private copy
            assert record.host is None and record.disk is not None
            assert record.resident.data_ptr() == store.files.view(record.disk).data_ptr()
        assert engine.stats.bytes_streamed > 0
        # the embedding table is only indexed: its rows are read by the lookup, never faulted in whole
        for graph in engine.plan.graphs:
            for spec in filter(None, graph.ahead.loads):
                for record, fault_in in zip(spec.mapped, spec.fault_in, strict=True):
                    assert fault_in == (record.name != "model.embed_tokens.weight")
        faulted: list[tuple[int, int]] = []
        fault = store.files._fault
        store.files._fault = lambda ranges: (faulted.extend(ranges), fault(ranges))
        store.evict("model.embed_tokens.weight")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
        table = store.files.view(store.records["model.embed_tokens.weight"].disk)
        low, high = table.data_ptr(), table.data_ptr() + table.numel() * 4
        overlap = sum(max(0, min(start + length, high) - max(start, low)) for start, length in faulted)
        assert faulted and overlap < 2 * 4096  # at most the pages it shares with its neighbours
    finally:
        fxoffload_hf.restore(model)
