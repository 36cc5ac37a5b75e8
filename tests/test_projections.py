"""A weight projected through a conversion of its dtype (``W.float()``) streams in tiles, each tile
converting its own rows, bit for bit as eager: the uses found in captured graphs, the tile product, and
Ergo in bf16 (its output head computes ``F.linear(x.float(), weight.float())``) at a tenth of its weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxoffload_hf
from fxoffload_hf import tiles
from fxoffload_hf.noop_conversions import drop_noop_conversions
from fxoffload_hf.projections import blocking_use, compute_dtype, describe, projections


class _ConvertedAndSummed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.double()
        return F.linear(x.double(), weight) + weight.sum()


def _weight_of(captured_graph, module: nn.Module, x: torch.Tensor) -> fx.Node:
    """``module``'s captured graph's weight placeholder, no-op conversions dropped as the engine does."""
    gm, (weight,) = captured_graph(module, x)
    drop_noop_conversions(gm.graph, [weight])
    return weight


def test_a_projection_through_a_dtype_conversion_is_served_by_tiles(converted_head, captured_graph) -> None:
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    weight = _weight_of(captured_graph, converted_head(torch.bfloat16), x)
    ((projection, dtype),) = projections(weight)
    assert projection.target is torch._C._nn.linear and dtype is torch.float32
    assert blocking_use(weight) is None and compute_dtype(weight) is torch.float32


def test_a_conversion_read_by_anything_but_projections_blocks_tiles_by_name(captured_graph) -> None:
    weight = _weight_of(captured_graph, _ConvertedAndSummed(), torch.randn(3, 16))
    blocker = blocking_use(weight)
    assert blocker is not None and describe(blocker) == "`double` (call method)"
    assert projections(weight) == []


@pytest.mark.parametrize("per_tile", [16, 48])
def test_tiles_converting_their_rows_equal_the_converted_weights_product(per_tile: int) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 96, generator=generator).to(torch.bfloat16)
    x = torch.randn(5, 96, generator=generator)
    ranges = tiles.tile_ranges(200, per_tile)
    # a tile alone is the product of its rows converted (as on CUDA); on the CPU it may round otherwise
    # than the whole (with AVX-512 it does), and ``tile_linear`` computes it in the whole's shape
    alone = torch.cat([F.linear(x, weight[start:stop].float()) for start, stop in ranges], dim=-1)
    for op, expected in ((tiles.tile_linear, F.linear(x, weight.float())), (tiles.tile_linear_alone, alone)):
        filled = None
        for start, stop in ranges:
            filled = op(x, weight[start:stop], None, start, 200, filled, torch.float32)
        assert filled is not None and filled.dtype == torch.float32
        assert torch.equal(filled, expected)


def test_a_conversion_between_dtypes_of_one_size_is_counted_too() -> None:
    # bf16 rows computed in fp16: the rows, their fp16 copy and its copy in the buffer, two bytes each
    assert tiles.tile_held_bytes((32, 8), 2, 32, "cpu", torch.float16) == 32 * 8 * 6


def test_a_converted_tile_is_counted_with_its_converted_copies() -> None:
    # bf16 rows converted to fp32: the rows (2 bytes), the converted copy and its copy in the
    # whole-shaped buffer (4 bytes each)
    shape = (32, 8)
    assert tiles.tile_held_bytes(shape, 2, 32, "cpu", torch.float32) == 32 * 8 * (2 + 4 + 4)
    assert tiles.tile_held_bytes(shape, 2, 32, "cpu") == 32 * 8 * 2 * 2
    assert tiles.tile_held_bytes(shape, 2, 32, "cuda", torch.float32) == 32 * 8 * (2 + 4)


@pytest.fixture
def bf16_ergo(tmp_path, checkpoint_config) -> tuple[nn.Module, int, torch.Tensor]:
    """Ergo of vocabulary 32,000 and width 256 saved in bf16 at ``tmp_path``: Hugging Face's own load of
    it, its weights' bytes, and a prompt."""
    import transformers

    torch.manual_seed(0)
    config = checkpoint_config("ergo-vocab-heavy")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    return eager, weights, torch.randint(3, 32000, (1, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_bf16_ergo_head_streams_in_converting_tiles_at_a_tenth_of_its_weights(tmp_path, bf16_ergo) -> None:
    eager, weights, ids = bf16_ergo
    greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
    model = fxoffload_hf.from_pretrained(
        tmp_path, offload="fx", cpu_memory=weights // 10, capture="first-call", dtype=torch.bfloat16
    )
    try:
        with torch.no_grad():
            got = model.generate(ids, **greedy)
        assert torch.equal(got.sequences, expected.sequences)
        for score, eager_score in zip(got.scores, expected.scores, strict=True):
            assert score.dtype == torch.float32 and torch.equal(score, eager_score)
        records = fxoffload_hf.engine_of(model).store.records
        head = [r for r in records.values() if r.tile_of == "lm_head.weight"]
        assert head, "the output head was not tiled"
        # weights that fit once the head is in tiles are not cut into one tile of all their rows
        tiled = [r for r in records.values() if r.tile_of]
        assert [r.name for r in tiled if r.tile_rows == (0, records[r.tile_of].shape[0])] == []
        assert all(r.tile_compute_dtype is torch.float32 and r.footprint == 5 * r.nbytes for r in head)
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.slow
@pytest.mark.usefixtures("counted_graph_state")
def test_the_budget_a_refusal_names_for_converting_tiles_is_larger_and_runs(tmp_path, bf16_ergo) -> None:
    # a converted tile holds five times its rows: a refusal that counted it as a plain tile (twice) named
    # a budget the next capture refused again, naming a smaller one
    _eager, _weights, ids = bf16_ergo
    budget, named = 4 * 2**20, []
    for _ in range(5):
        model = fxoffload_hf.from_pretrained(
            tmp_path, offload="fx", cpu_memory=budget, capture="first-call", dtype=torch.bfloat16
        )
        try:
            with torch.no_grad():
                model(ids)
            break
        except fxoffload_hf.BudgetTooSmallError as refusal:
            assert refusal.smallest_budget > budget, f"refused at {budget}, naming {refusal.smallest_budget}"
            budget = refusal.smallest_budget
            named.append(budget)
        finally:
            fxoffload_hf.restore(model)
    else:
        pytest.fail(f"still refused after following {named}")


@pytest.mark.slow
def test_bf16_ergo_runs_where_its_head_fits_whole_but_not_beside_its_fp32_copy(tmp_path, bf16_ergo) -> None:
    # at 70% of its weights the head (15.6 MiB) fits beside the others, not beside its whole fp32 copy
    # (31.3 MiB) too: tiled, it runs (skipped as fitting whole, the partition refused it)
    eager, weights, ids = bf16_ergo
    with torch.no_grad():
        expected = eager(ids).logits
    model = fxoffload_hf.from_pretrained(
        tmp_path, offload="fx", cpu_memory=int(weights * 0.7), capture="first-call", dtype=torch.bfloat16
    )
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
    finally:
        fxoffload_hf.restore(model)
