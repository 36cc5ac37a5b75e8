"""Weights too large for a piece stream in tiles of rows and give eager's output bit for bit: the tile
computation itself on shapes where slicing the weight does not, the store's tile records, and whole
models with a vocabulary large against their hidden size at 5-15% of their weights."""

from __future__ import annotations

import math
import mmap
import os

import pytest
import torch
from torch import nn

import fxoffload_hf
from fxoffload_hf import tile_buffer, tiles
from fxoffload_hf.memory_model import BudgetTooSmallError
from fxoffload_hf.safetensors_io import TensorSlice
from fxoffload_hf.weights import WeightStore


def tiled(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, per_tile: int) -> torch.Tensor:
    """``linear(x, weight, bias)`` computed tile by tile, as a rewritten graph does."""
    filled = None
    for start, stop in tiles.tile_ranges(weight.shape[0], per_tile):
        filled = tiles.tile_linear(x, weight[start:stop], bias, start, weight.shape[0], filled)
    assert filled is not None
    return filled


# (rows, columns, tokens): a matrix-vector product over an odd number of rows (MKL computes a row
# pair's tail apart, so slices of the weight round differently from the whole), a reduction MKL may
# split among threads by shape, and ordinary shapes
@pytest.mark.parametrize(
    ("rows", "cols", "tokens"), [(50257, 256, 1), (1000, 1024, 33), (32000, 256, 7), (4099, 64, 2)]
)
@pytest.mark.parametrize("per_tile", [4096, 1000])
def test_tile_linear_equals_the_whole_projection(rows: int, cols: int, tokens: int, per_tile: int) -> None:
    gen = torch.Generator().manual_seed(rows + tokens)
    weight = torch.randn(rows, cols, generator=gen)
    bias = torch.randn(rows, generator=gen)
    x = torch.randn(2, tokens, cols, generator=gen)
    assert torch.equal(tiled(x, weight, None, per_tile), torch.nn.functional.linear(x, weight))
    assert torch.equal(tiled(x, weight, bias, per_tile), torch.nn.functional.linear(x, weight, bias))


def test_a_tiles_pages_are_given_back() -> None:
    """After the last tile of a projection its buffer reads as zeros again and the slot that held the
    tiles' copies is empty: no copy outlives the call."""
    weight = torch.randn(3000, 256)  # 1 KiB rows: four to a page
    x = torch.randn(1, 256)
    filled = None
    for start, stop in tiles.tile_ranges(3000, 1024):
        filled = tiles.tile_linear(x, weight[start:stop], None, start, 3000, filled)
        buffer = tile_buffer.whole_shaped((3000, 256), torch.float32)
        assert not buffer.tensor.any()  # between tiles too
    assert buffer.slot_bytes == 0 and os.fstat(buffer.slot).st_size == 0
    assert torch.equal(filled, torch.nn.functional.linear(x, weight))


@pytest.mark.parametrize(("cols", "itemsize"), [(256, 4), (1000, 2), (3, 4), (8192, 2)])
@pytest.mark.parametrize("target", [0, 5000, 70_000, 2**20 + 4096, 2**30])
def test_rows_per_tile_fills_whole_pages_within_the_target(cols: int, itemsize: int, target: int) -> None:
    rows = tiles.rows_per_tile((100_000, cols), itemsize, target)
    row_bytes = cols * itemsize
    assert rows * row_bytes % mmap.PAGESIZE == 0 or rows == 100_000
    assert rows * row_bytes <= target or rows == 0
    # the most rows within the target, in whole row groups where one fits (``ROW_GROUP``)
    step = math.lcm(tiles.fewest_rows((100_000, cols), itemsize), tiles.ROW_GROUP)
    fits_a_group = step * row_bytes <= target
    if not fits_a_group:
        step = tiles.fewest_rows((100_000, cols), itemsize)
    assert rows % step == 0 or rows == 100_000
    assert (rows + step) * row_bytes > target or rows == 100_000


def test_tile_records_point_into_their_weight(tmp_path) -> None:
    store = WeightStore(torch.device("cpu"))
    source = TensorSlice(tmp_path / "w.safetensors", "w", 128, 100 * 64 * 4, torch.float32, (100, 64))
    store.add_disk("w", source)
    tile = store.add_tile("w", 20, 50, copied=True)
    assert tile.disk is not None
    assert (tile.disk.offset, tile.disk.nbytes, tile.shape) == (128 + 20 * 256, 30 * 256, (30, 64))
    assert tile.footprint == 2 * tile.nbytes  # held twice while it computes: streamed, and copied
    assert store.add_tile("w", 20, 50, copied=True) is tile
    assert [r.name for r in store.weights()] == ["w"]
    host = torch.arange(12.0).view(6, 2)
    store.add_host("h", host)
    assert torch.equal(store.add_tile("h", 2, 4, copied=True).host, host[2:4])
    store.set_dtype("h", torch.float64)
    assert store.records["h[2:4]"].host.dtype == torch.float64


def _vocab_heavy_llama(folder):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def _odd_vocab_gpt2(folder):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_embd=64, n_layer=2, n_head=4)  # tied head
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    return model


def _weights(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Three prompts of different lengths, left-padded, with their mask."""
    ids = torch.randint(1, 30000, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 4, 6)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


@pytest.mark.parametrize(("make", "share"), [(_vocab_heavy_llama, 0.05), (_odd_vocab_gpt2, 0.15)])
def test_generate_with_tiled_output_head_equals_eager(tmp_path, make, share: float) -> None:
    eager = make(tmp_path)
    ids, mask = _prompts()
    greedy = dict(
        max_new_tokens=5, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    with torch.no_grad():
        expected = eager.generate(ids, attention_mask=mask, **greedy)
    budget = int(_weights(eager) * share)
    model = fxoffload_hf.from_pretrained(tmp_path, offload="fx", cpu_memory=budget)
    try:
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, **greedy)
        assert torch.equal(got.sequences, expected.sequences)
        for score, eager_score in zip(got.scores, expected.scores, strict=True):
            assert torch.equal(score, eager_score)
        engine = fxoffload_hf.engine_of(model)
        assert any(r.tile_of for r in engine.store.records.values()), "the output head was not tiled"
        assert engine.plan is not None and engine.plan.in_flight_bytes <= budget
    finally:
        fxoffload_hf.restore(model)


class _Transposed(nn.Module):
    """A large weight used through ``matmul`` with its transpose: not a projection tiles can serve."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(256, 4096, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.head.weight.t())


def test_a_weight_no_tile_can_serve_is_refused_naming_its_use() -> None:
    model = fxoffload_hf.offload(_Transposed(), cpu_memory=2 * 2**20)  # the weight takes 4 MiB
    try:
        with pytest.raises(
            BudgetTooSmallError, match=r"head.weight takes 4.00 MiB and must fit whole: its use by `t`"
        ):
            model(torch.randn(1, 256))
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.parametrize("data_start", [0, 8])
def test_tiles_mapped_from_their_file_or_copied_equal_eager(tmp_path, tile_holds, data_start: int) -> None:
    """A tile that is a view of its checkpoint file is mapped into the whole-shaped buffer with no copy
    where its weight lies 16-byte aligned in the file (``hold_file``), else copied (``hold``); eager's
    logits and decode scores bit for bit either way."""
    from fxoffload_hf.align import align_shards_in_place

    eager = _vocab_heavy_llama(tmp_path)
    align_shards_in_place(tmp_path, data_start)
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = eager(ids).logits
    model = fxoffload_hf.from_pretrained(tmp_path, offload="fx", cpu_memory=int(_weights(eager) * 0.1))
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
            greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
            got, want = model.generate(ids, **greedy), eager.generate(ids, **greedy)  # decode: one token
            assert torch.equal(got.sequences, want.sequences)
            assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    finally:
        fxoffload_hf.restore(model)
    assert tile_holds and set(tile_holds) == ({"hold_file"} if data_start == 0 else {"hold"})


@pytest.mark.usefixtures("counted_graph_state")
def test_tiles_are_sized_beside_the_graphs_state(tmp_path, save_checkpoint, logits) -> None:
    """Tiles take their share of the room the captured graphs' state and the capture's transient leave:
    sized as if that room were the budget's, they did not fit once partitioned, and each refusal named a
    budget that was refused again (12 MiB: "pass 13.3 MiB"; 14 MiB: "pass 14.3 MiB")."""
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    ids = torch.randint(1, 32000, (1, 9), generator=torch.Generator().manual_seed(2))
    for budget in ("12MiB", "14MiB"):
        model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu", capture="first-call")
        try:
            assert torch.equal(logits(model, ids), logits(eager, ids))
            assert len(fxoffload_hf.engine_of(model).runners) == 1
        finally:
            fxoffload_hf.restore(model)


@pytest.mark.parametrize("shape", [(100_000, 64), (16_384, 1024), (300, 1000)])
def test_a_graphs_weight_is_cut_into_at_most_most_graph_tiles_tiles(shape) -> None:
    """Tiles of rows take at least a weight's ``MOST_GRAPH_TILES``-th (a budget that would cut it finer gets
    none: the weight then streams whole where it fits, or the budget is refused naming that tile)."""
    itemsize, row = 4, shape[1] * 4
    fewest = tiles.fewest_tile_rows(shape, itemsize)
    assert -(-shape[0] // fewest) <= tiles.MOST_GRAPH_TILES
    assert fewest % tiles.fewest_rows(shape, itemsize) == 0 or fewest == shape[0]
    assert tiles.graph_tile_rows(shape, itemsize, fewest * row - 1) == 0
    assert tiles.graph_tile_rows(shape, itemsize, fewest * row) == fewest
    if fewest > tiles.fewest_rows(shape, itemsize):  # finer tiles exist, but are not made
        assert 0 < tiles.rows_per_tile(shape, itemsize, fewest * row // 4) < fewest
    assert tiles.smallest_tile_bytes(shape, itemsize, "cpu") == 2 * fewest * row
