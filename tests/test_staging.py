"""Staging arena and disk reads on CPU tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from fxoffload_hf.memory_model import pair_bytes, piece_bytes
from fxoffload_hf.safetensors_io import CheckpointError, read_header, read_into
from fxoffload_hf.staging import StagingArena
from fxoffload_hf.weights import as_typed


def test_consecutive_pieces_never_overlap_in_the_arena():
    sizes = [[300, 200], [1000], [64, 64, 64], [900, 37]]
    arena = StagingArena(pin=False)
    arena.resize(pair_bytes([piece_bytes(s) for s in sizes]))
    previous: list[torch.Tensor] = []
    for index, piece in enumerate(sizes):
        views = arena.layout(piece, index % 2)
        for v in views:
            v.fill_(index + 1)
        for old in previous:  # the piece before is still intact
            assert bool((old == index).all())
        previous = views


def test_arena_refuses_a_piece_larger_than_itself():
    arena = StagingArena(pin=False)
    arena.resize(128)
    with pytest.raises(RuntimeError, match="cannot hold"):
        arena.layout([1000], 0)


def test_reads_are_exact_and_coalesced(tmp_path):
    tensors = {f"t{i}": torch.randn(100 + i, 7) for i in range(5)}
    tensors["h"] = torch.randn(33).to(torch.bfloat16)
    save_file(tensors, tmp_path / "a.safetensors")
    slices = read_header(tmp_path / "a.safetensors")
    chosen = [slices[k] for k in ("t3", "t0", "h", "t1")]
    buffers = [torch.empty(s.nbytes, dtype=torch.uint8) for s in chosen]
    read_into(chosen, buffers)
    for s, b in zip(chosen, buffers, strict=True):
        assert torch.equal(as_typed(b, s), tensors[s.key])


def test_truncated_file_is_named(tmp_path):
    save_file({"w": torch.randn(1000)}, tmp_path / "a.safetensors")
    data = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "a.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="a.safetensors.*truncated"):
        read_header(tmp_path / "a.safetensors")


def test_detach_clones_only_what_views_the_arena():
    arena = StagingArena(pin=False)
    arena.resize(256)
    (view,) = arena.layout([64], 0)
    inside, outside = view.view(torch.float32), torch.ones(4)
    inside.fill_(3.0)
    kept_inside, kept_outside = arena.detach((inside, [outside]))
    assert kept_outside[0] is outside
    assert kept_inside is not inside and torch.equal(kept_inside, inside)
    view.fill_(0)  # the next load overwrites the arena: the detached value stays
    assert bool((kept_inside == 3.0).all())
