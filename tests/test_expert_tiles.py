"""Stacked expert weights too large for a piece stream in tiles of whole experts, exact: the tile product
against the whole grouped product, whole mixture-of-experts models at 8-15% of their weights, and the
plan's floor."""

from __future__ import annotations

import pytest
import torch
import transformers
import transformers.integrations.moe  # noqa: F401 - registers Transformers' grouped product fallback
from torch import fx

import fxoffload_hf
from fxoffload_hf import expert_tiles, tiles
from fxoffload_hf.align import align_shards_in_place

_PRODUCTS = {
    "fallback": lambda tokens, weight, offs: torch.ops.transformers.grouped_mm_fallback(
        tokens, weight, offs=offs
    ),
    "_grouped_mm": lambda tokens, weight, offs: torch._grouped_mm(tokens, weight, offs=offs),
}


def _tiled(tokens, stacked, ends, per_tile: int, transposed: bool, product: str) -> torch.Tensor:
    filled = None
    for start, stop in tiles.tile_ranges(stacked.shape[0], per_tile):
        tile = stacked[start:stop]
        filled = expert_tiles.tile_grouped_mm(
            tokens, tile, ends, start, stacked.shape[0], transposed, product, filled
        )
    assert filled is not None
    return filled


@pytest.mark.parametrize("product", ["fallback", "_grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("per_tile", [1, 3, 8])
def test_tiles_of_experts_equal_the_whole_grouped_product(product, dtype, transposed, per_tile) -> None:
    """Experts with no tokens among them (as routing leaves some), tiles that end past the last."""
    gen = torch.Generator().manual_seed(per_tile)
    counts = torch.tensor([3, 0, 5, 1, 7, 0, 2, 4])
    ends = torch.cumsum(counts, 0).to(torch.int32)
    tokens = torch.randn(int(counts.sum()), 64, generator=gen).to(dtype)
    # stored as Transformers stores them: (experts, out, in), used transposed; or (experts, in, out)
    stacked = torch.randn(8, 96, 64, generator=gen).to(dtype)
    if not transposed:
        stacked = stacked.transpose(-2, -1).contiguous()
    used = stacked.transpose(-2, -1) if transposed else stacked
    whole = _PRODUCTS[product](tokens, used, ends)
    assert torch.equal(_tiled(tokens, stacked, ends, per_tile, transposed, product), whole)


def _moe(config, folder, dtype=torch.float32) -> torch.nn.Module:
    """A seeded MoE model of ``config`` (``checkpoint_config``'s) saved to ``folder`` in ``dtype``, aligned."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.save_pretrained(folder, max_shard_size="2MB")
    align_shards_in_place(folder)
    return model


@pytest.mark.parametrize(
    ("arch", "share"), [("mixtral-8-experts", 0.08), ("qwen3_moe", 0.1), ("gpt_oss", 0.1)]
)
def test_moe_models_stream_their_experts_in_tiles_and_equal_eager(
    arch, share, tmp_path, checkpoint_config, weight_bytes
) -> None:
    """At budgets below one stacked weight (it needs 26-30% of these models' weights), in captured graphs."""
    eager = _moe(checkpoint_config(arch), tmp_path)
    weights = weight_bytes(eager)
    largest = max(p.numel() * p.element_size() for p in eager.parameters())
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        expected, expected_tokens = eager(ids).logits, eager.generate(ids, **greedy)
    assert int(weights * share) < largest
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=int(weights * share), device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
            assert torch.equal(model.generate(ids, **greedy), expected_tokens)
        store = fxoffload_hf.engine_of(model).store
        experts = [r for r in store.records.values() if r.tile_of and "experts" in r.tile_of]
        assert experts and all(len(r.shape) == 3 and r.footprint == r.nbytes for r in experts)
    finally:
        fxoffload_hf.restore(model)


def test_a_stacked_weight_other_ops_use_is_refused_by_name() -> None:
    """Only the stacked operand of grouped products streams in tiles of experts; a batched product reads
    every expert's weight for every row."""
    graph = fx.Graph()
    x, stacked = graph.placeholder("x"), graph.placeholder("stacked")
    graph.output(graph.call_function(torch.bmm, (x, stacked)))
    assert not expert_tiles.can_tile_experts(stacked, (8, 64, 96))
    assert not tiles.can_tile(stacked, (8, 64, 96))


def test_the_plans_floor_is_set_by_a_tile_of_experts(tmp_path, checkpoint_config) -> None:
    """Not by the stacked weight streamed whole; and a call of the planned length runs there, exactly."""
    from fxoffload_hf.plan import plan_checkpoint

    eager = _moe(checkpoint_config("mixtral-8-experts"), tmp_path)
    largest = max(p.numel() * p.element_size() for p in eager.parameters())
    report = plan_checkpoint(tmp_path, cpu_memory="1GiB", seq_len=8)
    assert (
        "experts.gate_up_proj" in report.floor_set_by and "smallest tiles of experts" in report.floor_set_by
    )
    assert report.smallest_budget < largest + report.activation_bytes
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = eager(ids).logits
    model = fxoffload_hf.from_pretrained(
        tmp_path, cpu_memory=report.smallest_budget, device="cpu", capture="first-call"
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
    finally:
        fxoffload_hf.restore(model)


def test_a_bf16_moe_model_is_captured_with_its_experts_in_tiles(
    tmp_path, checkpoint_config, weight_bytes
) -> None:
    """torch's grouped product (Transformers' choice for bf16) checks the weight's strides as it traces,
    which a ghost lacks: traced calls of an offloaded model on the CPU take Transformers' fallback, the
    same per-expert products (``eager_paths``). Against Transformers' own load of the checkpoint (a model
    converted in memory keeps its rotary frequencies in bf16, a loaded one computes them in fp32)."""
    _moe(checkpoint_config("mixtral-8-experts"), tmp_path, torch.bfloat16)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert eager.dtype == torch.bfloat16
    weights = weight_bytes(eager)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        expected, expected_tokens = eager(ids).logits, eager.generate(ids, **greedy)
    model = fxoffload_hf.from_pretrained(
        tmp_path, cpu_memory=weights // 10, device="cpu", capture="first-call"
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
            assert torch.equal(model.generate(ids, **greedy), expected_tokens)
        store = fxoffload_hf.engine_of(model).store
        assert any(r.tile_of and "experts" in r.tile_of for r in store.records.values())
    finally:
        fxoffload_hf.restore(model)


def test_transformers_fallback_computes_what_torchs_grouped_product_does_on_the_cpu() -> None:
    """What lets a traced call take the fallback where eager takes torch's product (``eager_paths``)."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for experts, width, out, tokens in [(8, 128, 512, 30), (16, 256, 96, 7), (4, 64, 64, 1)]:
            counts = torch.randint(0, 4, (experts,), generator=gen)
            counts[0] += tokens
            ends = torch.cumsum(counts, 0).to(torch.int32)
            x = torch.randn(int(counts.sum()), width, generator=gen).to(dtype)
            weight = torch.randn(experts, out, width, generator=gen).to(dtype).transpose(-2, -1)
            assert torch.equal(
                _PRODUCTS["fallback"](x, weight, ends), _PRODUCTS["_grouped_mm"](x, weight, ends)
            )
