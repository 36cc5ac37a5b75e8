"""Conversions of a weight to what it is already are dropped from captured graphs, so that a projection
computed through one can stream in tiles: on a toy graph, and on Ergo, whose output head computes
``F.linear(x.float(), weight.to(x.dtype).float())``, at a tenth of its weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fxoffload_hf
from fxoffload_hf.noop_conversions import drop_noop_conversions, has_noop_conversions


def test_conversions_of_a_weight_to_its_own_dtype_are_dropped(converted_head, captured_graph) -> None:
    module, x = converted_head(torch.float32), torch.randn(3, 16)
    gm, weights = captured_graph(module, x)
    assert has_noop_conversions(weights)
    assert drop_noop_conversions(gm.graph, weights) == 2  # ``to(x.dtype)``, then ``float()``
    gm.recompile()
    (weight,) = weights
    assert [u.target for u in weight.users] == [torch._C._nn.linear]
    inputs = [module.weight if n in weights else x for n in gm.graph.nodes if n.op == "placeholder"]
    (out,) = gm(*inputs)
    assert torch.equal(out, F.linear(x, module.weight))


def test_a_conversion_to_another_dtype_is_kept(converted_head, captured_graph) -> None:
    gm, weights = captured_graph(converted_head(torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16))
    # ``to(bfloat16)`` of a bf16 weight returns it; ``float()`` of it converts
    assert drop_noop_conversions(gm.graph, weights) == 1
    (weight,) = weights
    assert [u.target for u in weight.users] == ["float"]
    assert not has_noop_conversions(weights)


class _CopiedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(torch.float32, False, True))  # non_blocking, copy by position


def test_a_conversion_that_copies_is_kept(captured_graph) -> None:
    gm, weights = captured_graph(_CopiedHead(), torch.randn(3, 16))
    assert not has_noop_conversions(weights) and drop_noop_conversions(gm.graph, weights) == 0


@pytest.mark.slow
def test_ergo_head_streams_in_tiles_at_a_tenth_of_its_weights(tmp_path, checkpoint_config) -> None:
    import transformers

    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(checkpoint_config("ergo-vocab-heavy")).eval()
    eager.save_pretrained(tmp_path)
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    ids = torch.randint(3, 32000, (1, 12), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
    model = fxoffload_hf.from_pretrained(
        tmp_path, offload="fx", cpu_memory=weights // 10, capture="first-call"
    )
    try:
        with torch.no_grad():
            got = model.generate(ids, **greedy)
        assert torch.equal(got.sequences, expected.sequences)
        for score, eager_score in zip(got.scores, expected.scores, strict=True):
            assert torch.equal(score, eager_score)
        records = fxoffload_hf.engine_of(model).store.records.values()
        assert any(r.tile_of == "lm_head.weight" for r in records), "the output head was not tiled"
    finally:
        fxoffload_hf.restore(model)
