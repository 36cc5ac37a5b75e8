"""A GPU run's host RAM: weights read into it within ``cpu_memory``, and let go to make room for what
else lies there (captured graphs' state)."""

from __future__ import annotations

import torch

from fxoffload_hf import loaders
from fxoffload_hf.host_room import fit_host, read_into_ram
from fxoffload_hf.weight_record import Tier
from fxoffload_hf.weights import WeightStore

CUDA = torch.device("cuda")  # only the device's type is read: no GPU needed


def test_read_into_ram_fills_the_room_in_order_and_keeps_the_file_range(three_weights):
    # a GPU run reads file-only weights into RAM once, to copy them from pinned memory at each use
    tensors, slices = three_weights
    store = WeightStore(CUDA)
    try:
        a = store.add_disk("a", slices["a"])
        b = store.add_disk("b", slices["b"])
        h = store.add_disk("h", slices["h"], torch.float32)
        version = store.version
        read = read_into_ram(store, a.nbytes // 2 + b.nbytes + h.nbytes)  # "a" does not fit, the rest do
        assert read == b.nbytes + h.nbytes and store.version > version
        assert a.tier is Tier.DISK and b.tier is Tier.HOST and h.tier is Tier.HOST
        assert torch.equal(b.host, tensors["b"]) and torch.equal(h.host, tensors["h"].float())
        assert h.disk is slices["h"] and loaders.way_of(h, "cuda") is loaders.Way.COPIED
        assert read_into_ram(store, 0) == 0 and store.ram_bytes() == read
    finally:
        store.close()


def test_fit_host_drops_file_copies_last_read_first_then_spills_what_only_ram_holds(three_weights, tmp_path):
    """Copies of weights that lie in a file go first (nothing written: they stream from the file again,
    their tiles with them), the model's last first; a weight only RAM holds is written to the offload
    folder, and only once the file copies are not enough."""
    tensors, slices = three_weights
    store = WeightStore(CUDA)
    try:
        a = store.add_disk("a", slices["a"])
        b = store.add_disk("b", slices["b"])
        ram = store.add_host("r", torch.randn(32, 32))
        read_into_ram(store, a.nbytes + b.nbytes)
        tile = store.add_tile("a", 0, 32, copied=False)
        assert tile.host is not None and store.ram_bytes() == a.nbytes + b.nbytes + ram.nbytes
        folder = tmp_path / "offload"
        assert fit_host(store, store.ram_bytes(), folder) == 0  # it fits: nothing moves
        assert fit_host(store, a.nbytes + ram.nbytes, folder) == b.nbytes  # "b" was read last
        assert b.tier is Tier.DISK and a.tier is Tier.HOST and not folder.exists()
        version = store.version
        assert fit_host(store, ram.nbytes, folder) == a.nbytes
        assert a.tier is Tier.DISK and tile.host is None and store.version > version
        assert loaders.way_of(tile, "cuda") is loaders.Way.STAGED and ram.tier is Tier.HOST
        values = ram.host.clone()
        assert fit_host(store, 0, folder) == ram.nbytes and ram.tier is Tier.DISK
        assert len(list(folder.glob("*.safetensors"))) == 1
        assert torch.equal(store.read(ram), values) and torch.equal(store.read(a), tensors["a"])
    finally:
        store.close()
