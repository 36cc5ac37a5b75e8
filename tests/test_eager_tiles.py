"""Eager calls of a projection too large to lend whole are computed in tiles of rows: deferred capture
(the default) then runs a vocabulary-heavy model eagerly at budgets below its output head, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import fxoffload_hf
from fxoffload_hf import eager_tiles, tiles
from fxoffload_hf.align import align_shards_in_place
from fxoffload_hf.eager_fallback import EagerWeights
from fxoffload_hf.eager_memory import eager_call_bytes
from fxoffload_hf.safetensors_io import TensorSlice
from fxoffload_hf.weight_record import WeightRecord

_TABLE = 32000 * 256 * 4  # the output head (and embedding table) of the vocabulary-heavy checkpoints


def _eager_hooks(engine) -> EagerWeights:
    """The hooks that lend an engine's model its weights in eager calls."""
    return next(h for h in engine.memory_holders if isinstance(h, EagerWeights))


def _generate(model, ids):
    greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        return model.generate(ids, pad_token_id=0, **greedy)


@pytest.mark.parametrize(
    ("arch", "share"),
    [
        ("llama-vocab-heavy", 3),
        ("gpt2-vocab-heavy", 3),
        ("gpt2-vocab-heavy", 5),
        ("gpt2-vocab-heavy", 10),
        ("gemma2-vocab-heavy", 5),
        ("gemma2-vocab-heavy", 10),
    ],
)
def test_a_head_too_large_to_lend_whole_runs_eagerly_in_tiles_bit_for_bit(
    tmp_path, save_checkpoint, arch, share
):
    """At a third, a fifth or a tenth of the output head (the last under a tenth of the weights), the head
    is lent a tile at a time (GPT-2's and Gemma-2's are tied to their embedding tables, whose lookups read
    rows; Gemma-2's through a scaled embedding's own forward): the calls run eagerly, no graph captured,
    eager's tokens and scores."""
    eager = save_checkpoint(arch, tmp_path)
    ids = torch.randint(1, 32000, (2, 9), generator=torch.Generator().manual_seed(2))
    expected = _generate(eager, ids)
    budget = _TABLE // share
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu", capture="deferred")
    try:
        got = _generate(model, ids)
        assert torch.equal(got.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
        engine = fxoffload_hf.engine_of(model)
        assert engine.runners == [] and engine.stats.eager_calls == 4 and engine.deferring
        hooks = _eager_hooks(engine)
        (head,) = hooks.tiles.rows
        # a tile and its copy, each within a quarter of the room, not the whole head
        assert hooks.lent_bytes(head) <= budget // 2
        assert any(r.tile_of is not None for r in engine.store.records.values())
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.parametrize("data_start", [0, 8])
def test_eager_tiles_mapped_from_their_file_or_copied_equal_eager(
    tmp_path, save_checkpoint, tile_holds, data_start, deferred_run
):
    """A tile lent as a view of its file's pages is mapped into the whole-shaped buffer where its weight
    lies 16-byte aligned (``hold_file``), else copied (``hold``): eager's logits bit for bit either way."""
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    align_shards_in_place(tmp_path, data_start)
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = eager(ids).logits
    got, eager_calls = deferred_run(tmp_path, _TABLE // 3, ids)
    assert torch.equal(got, expected) and eager_calls == 1
    assert tile_holds and set(tile_holds) == ({"hold_file"} if data_start == 0 else {"hold"})


def test_eager_tiles_of_a_converted_weight_are_read_and_converted(tmp_path, save_checkpoint):
    """After ``.to(bfloat16)`` the file's fp32 bytes cannot serve as they lie: each tile is read and
    converted, and the logits equal the bf16 model's. (The embedding table, converted too, is lent whole:
    the budget holds it, not the head with its converted copy.)"""
    eager = save_checkpoint("llama-vocab-heavy", tmp_path).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = eager(ids).logits
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2 * _TABLE, device="cpu", capture="deferred")
    try:
        model.to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
        assert fxoffload_hf.engine_of(model).stats.eager_calls == 1
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.parametrize("room", [0, 8 * 2**20, 40 * 2**20, 200 * 2**20])
def test_eager_tiles_fill_a_quarter_of_the_room_in_whole_pages_and_are_few(tmp_path, room):
    """On the CPU a weight is tiled where it cannot be lent beside another as large (more than half the
    room), in tiles of whole pages within a quarter of the room (held twice while one computes), but
    never more than ``MOST_TILES`` of them: each tile's call computes the whole projection."""
    record = WeightRecord("head.weight", (32000, 256), torch.float32)
    record.disk = TensorSlice(
        tmp_path / "x.safetensors", "head.weight", 0, _TABLE, torch.float32, (32000, 256)
    )
    rows = eager_tiles.rows_per_eager_tile(record, room, "cpu")
    if record.footprint <= room // 2:  # 31.25 MiB: lent whole in 200 MiB
        assert rows is None
        return
    assert rows is not None and rows % tiles.fewest_rows((32000, 256), 4) == 0
    assert -(-32000 // rows) <= eager_tiles.MOST_TILES
    held = eager_tiles.tile_bytes(record, rows, "cpu")
    # within half the room, or as small as MOST_TILES allows: a row group fewer would make more tiles
    group = math.lcm(tiles.fewest_rows((32000, 256), 4), tiles.ROW_GROUP)
    assert held <= room // 2 or -(-32000 // (rows - group)) > eager_tiles.MOST_TILES
    assert eager_tiles.tile_bytes(record, rows, "cuda") == rows * 256 * 4
    # on CUDA a tile computes alone, rounding unlike the whole: tiled only where it cannot fit even alone
    assert (eager_tiles.rows_per_eager_tile(record, room, "cuda") is None) == (record.footprint <= room)


def test_only_plain_linear_projections_are_tiled_in_eager_calls() -> None:
    class Scaled(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    assert eager_tiles.projects_by_rows(torch.nn.Linear(4, 8))
    assert not eager_tiles.projects_by_rows(Scaled(4, 8))
    assert not eager_tiles.projects_by_rows(torch.nn.Embedding(8, 4))


def test_a_head_is_lent_whole_while_calls_fit_and_in_tiles_from_the_first_that_does_not(
    tmp_path, save_checkpoint, logits
):
    """Tiles compute the projection once per tile, so a head that fits beside a call is lent whole; the
    first call whose bound does not fit beside it turns the tiles on (and they stay on: the weights kept
    for eager calls are chosen for them), each call eager and exact."""
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    short = torch.randint(0, 32000, (1, 4), generator=torch.Generator().manual_seed(5))
    long = torch.randint(0, 32000, (2, 40), generator=torch.Generator().manual_seed(6))
    bound = eager_call_bytes(eager, (long,), {})
    assert bound is not None and eager_call_bytes(eager, (short,), {}) < bound - 4 * 2**20
    budget = bound + _TABLE - 2 * 2**20  # the long call's bound and the whole head do not fit
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu", capture="deferred")
    engine = fxoffload_hf.engine_of(model)
    hooks = _eager_hooks(engine)
    try:
        assert torch.equal(logits(model, short), logits(eager, short))
        assert not hooks.tiles.on and not any(r.tile_of for r in engine.store.records.values())
        assert torch.equal(logits(model, long), logits(eager, long))
        assert hooks.tiles.on and any(r.tile_of == "lm_head.weight" for r in engine.store.records.values())
        assert torch.equal(logits(model, short), logits(eager, short))
        assert hooks.tiles.on and engine.stats.eager_calls == 3 and engine.runners == []
    finally:
        fxoffload_hf.restore(model)


def test_a_call_that_does_not_fit_even_in_tiles_is_captured_and_leaves_them_off(
    tmp_path, save_checkpoint, logits
):
    """Tiles are turned on only where they let the call run eagerly: a call whose bound alone fills the
    budget is captured, and the projections stay lent whole for later eager calls."""
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    wide = torch.randint(0, 32000, (2, 20), generator=torch.Generator().manual_seed(8))
    budget = _TABLE // 3
    assert eager_call_bytes(eager, (wide,), {}) > budget
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu", capture="deferred")
    engine = fxoffload_hf.engine_of(model)
    hooks = _eager_hooks(engine)
    try:
        assert torch.equal(logits(model, wide), logits(eager, wide))
        assert engine.stats.eager_calls == 0 and len(engine.runners) == 1 and not hooks.tiles.on
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.usefixtures("counted_graph_state")
def test_a_refused_capture_names_the_budget_eager_calls_need_with_the_head_in_tiles(
    tmp_path, logits, deferred_refusal
):
    """Where neither an eager call nor its capture fits (eight layers' graph state), the refusal names the
    smallest budget of eager calls, the head in its smallest tiles, and a model given it runs
    eagerly, exactly."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.LlamaForCausalLM(config).eval()
    eager.save_pretrained(tmp_path)
    align_shards_in_place(tmp_path)
    ids = torch.randint(1, 32000, (1, 16), generator=torch.Generator().manual_seed(9))
    floor = deferred_refusal(tmp_path, "3MiB", ids, "to run its calls as eager code").smallest_budget
    assert floor < _TABLE // 2  # the head lent whole would need more
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=floor, device="cpu", capture="deferred")
    engine = fxoffload_hf.engine_of(model)
    hooks = _eager_hooks(engine)
    try:
        assert torch.equal(logits(model, ids), logits(eager, ids))
        assert engine.stats.eager_calls == 1 and engine.runners == [] and hooks.tiles.on
    finally:
        fxoffload_hf.restore(model)
