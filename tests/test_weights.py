"""The weight store: the one owner of where each weight lies, as a small state machine."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from fxoffload_hf.safetensors_io import read_header
from fxoffload_hf.weight_record import Tier
from fxoffload_hf.weights import WeightStore

CPU = torch.device("cpu")


def test_tiers_follow_keep_and_evict_on_the_cpu(three_weights):
    tensors, slices = three_weights
    store = WeightStore(CPU)
    try:
        record = store.add_disk("a", slices["a"])
        assert record.tier is Tier.DISK and record.tier.streams and record.tier.from_file
        version = store.version
        store.keep("a")  # used in place: its file's pages kept mapped
        assert record.tier is Tier.MAPPED and not record.tier.streams and record.host is None
        assert torch.equal(record.resident, tensors["a"]) and store.version > version
        store.evict("a")
        assert record.tier is Tier.DISK and record.resident is None
        converted = store.add_disk("h", slices["h"], torch.float32)  # a dtype change: not in place
        store.keep("h")
        assert converted.tier is Tier.DEVICE and torch.equal(converted.resident, tensors["h"].float())
    finally:
        store.close()


def test_a_weight_whose_only_copy_is_in_ram_cannot_be_evicted_on_the_cpu():
    store = WeightStore(CPU)
    value = torch.randn(8, 8)
    record = store.add_host("w", value)
    assert record.tier is Tier.DEVICE and not store.movable(record)
    assert record.resident is record.host and record.host.data_ptr() == value.data_ptr()  # held once
    version = store.version
    store.evict("w")
    store.set_residents(set())
    assert record.resident is record.host and store.version == version
    store.close()


def test_set_residents_keeps_exactly_the_movable_weights_wanted(three_weights):
    _tensors, slices = three_weights
    store = WeightStore(CPU)
    try:
        for name in ("a", "b"):
            store.add_disk(name, slices[name])
        store.set_residents({"a"})
        assert {n for n, r in store.records.items() if r.resident is not None} == {"a"}
        store.set_residents({"b"})
        assert {n for n, r in store.records.items() if r.resident is not None} == {"b"}
        assert store.kept_sources(list(store.records.values())) == [slices["b"]]
    finally:
        store.close()


def test_spill_moves_ram_weights_to_disk_and_empties_their_sharers(tmp_path):
    store = WeightStore(CPU)
    param = torch.nn.Parameter(torch.randn(32, 4))
    expected = param.detach().clone()
    record = store.add_host("w", param.data)
    store.sharers["w"] = [param]
    version = store.version
    store.spill(["w"], tmp_path)
    assert record.tier is Tier.DISK and record.host is None and store.version > version
    assert param.numel() == 0, "the model's parameter still holds the memory"
    assert torch.equal(store.read(record), expected)
    store.close()
    assert not list(tmp_path.glob("*.safetensors")), "spilled files outlive the store"


def test_a_forked_child_leaves_its_parents_spilled_files_alone(tmp_path):
    store = WeightStore(CPU)
    store.add_host("w", torch.randn(32, 4))
    spilled = store.spill(["w"], tmp_path)
    assert spilled is not None
    child = os.fork()
    if child == 0:  # the child's exit, or its collection of its copy of the store, runs the removal
        store._remove_written()
        os._exit(0)
    os.waitpid(child, 0)
    assert spilled.exists(), "a child removed the file its parent reads weights from"
    store.close()
    assert not spilled.exists()


def test_set_dtype_converts_ram_copies_now_and_bumps_the_version():
    store = WeightStore(CPU)
    record = store.add_host("w", torch.randn(4, 4))
    version = store.version
    store.set_dtype("w", torch.bfloat16)
    assert record.dtype == torch.bfloat16 and record.host.dtype == torch.bfloat16
    assert record.resident is record.host and store.version > version
    assert record.nbytes == 4 * 4 * 2
    store.close()


def test_held_bytes_counts_weights_used_in_place_by_the_2_mib_units_they_map_each_once(
    tmp_path, place_data_at
):
    rows = 3 * 2**20 // 2 // 4 // 256  # 1.5 MiB of fp32 rows each: neighbours share a 2 MiB unit
    tensors = {"p": torch.randn(rows, 256), "q": torch.randn(rows, 256), "h": torch.randn(64, 64).half()}
    save_file(tensors, tmp_path / "w.safetensors")
    place_data_at(tmp_path, 0)
    slices = read_header(tmp_path / "w.safetensors")
    store = WeightStore(CPU)
    try:
        p, q = store.add_disk("p", slices["p"]), store.add_disk("q", slices["q"])
        h = store.add_disk("h", slices["h"], torch.float32)  # converted: a copy, not in place
        assert store.keeps_in_place(p) and not store.keeps_in_place(h)
        alone = store.held_bytes([p])
        assert alone > p.nbytes  # its unit is mapped whole, with the part of q that lies in it
        both = store.held_bytes([p, q])
        assert p.nbytes + q.nbytes <= both < alone + store.held_bytes([q])  # the shared unit once
        assert store.held_bytes([h]) == h.footprint
        assert store.held_bytes([p, h]) == alone + h.footprint
    finally:
        store.close()


@pytest.mark.parametrize("drop_cache", [False, True])
def test_pages_are_read_ahead_only_where_the_page_cache_keeps_them(three_weights, drop_cache):
    # under a memory limit (pages dropped after each use) the kernel's read-ahead reads 4 KiB pages
    # that the next drop waits on: eager calls fault their pages in instead
    _, slices = three_weights
    store = WeightStore(CPU, drop_cache=drop_cache)
    try:
        group = store.files.group([slices["a"]], [True])
        asked: list = []
        store.files.read_ahead = asked.append  # type: ignore[method-assign]
        store.read_ahead(group)
        assert asked == ([] if drop_cache else [group])
    finally:
        store.close()


def test_a_tile_counts_the_widest_conversion_any_graph_asks_for():
    store = WeightStore(CPU)
    store.add_host("w", torch.randn(64, 8, dtype=torch.bfloat16))
    tile = store.add_tile("w", 0, 32, copied=True, compute_dtype=torch.float64)
    wide = tile.footprint
    assert store.add_tile("w", 0, 32, copied=True, compute_dtype=torch.float32) is tile
    assert tile.tile_compute_dtype is torch.float64 and tile.footprint == wide == 32 * 8 * (2 + 8 + 8)
    store.close()
