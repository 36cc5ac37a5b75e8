"""Conversions of a weight to what it is already are dropped from captured graphs, so that a projection
computed through one can stream in tiles: on a toy graph, and on Ergo, whose output head computes
``F.linear(x.float(), weight.to(x.dtype).float())``, at a tenth of its weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxoffload_hf
from fxoffload_hf.noop_conversions import drop_noop_conversions, has_noop_conversions


class _ConvertedHead(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 16, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.to(x.dtype).float())


def _captured(module: nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, list[fx.Node]]:
    graphs: list[fx.GraphModule] = []

    def backend(gm: fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        torch.compile(module, backend=backend, fullgraph=True)(x)
    finally:
        torch._dynamo.reset()
    (gm,) = graphs
    weights = [n for n in gm.graph.nodes if n.op == "placeholder" and "weight" in n.name]
    return gm, weights


def test_conversions_of_a_weight_to_its_own_dtype_are_dropped() -> None:
    module, x = _ConvertedHead(torch.float32), torch.randn(3, 16)
    gm, weights = _captured(module, x)
    assert has_noop_conversions(weights)
    assert drop_noop_conversions(gm.graph, weights) == 2  # ``to(x.dtype)``, then ``float()``
    gm.recompile()
    (weight,) = weights
    assert [u.target for u in weight.users] == [torch._C._nn.linear]
    inputs = [module.weight if n in weights else x for n in gm.graph.nodes if n.op == "placeholder"]
    (out,) = gm(*inputs)
    assert torch.equal(out, module(x))


def test_a_conversion_to_another_dtype_is_kept() -> None:
    module = _ConvertedHead(torch.bfloat16)
    gm, weights = _captured(module, torch.randn(3, 16, dtype=torch.bfloat16))
    # ``to(bfloat16)`` of a bf16 weight returns it; ``float()`` of it converts
    assert drop_noop_conversions(gm.graph, weights) == 1
    (weight,) = weights
    assert [u.target for u in weight.users] == ["float"]
    assert not has_noop_conversions(weights)


def _ergo(folder):
    import transformers

    torch.manual_seed(0)
    config = transformers.ErgoConfig(
        vocab_size=32000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        first_dense_intermediate_size=512, moe_intermediate_size=128, shared_intermediate_size=256,
        num_experts=4, num_experts_per_tok=2, sliding_window=16, global_attention_every_n_layers=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.slow
def test_ergo_head_streams_in_tiles_at_a_tenth_of_its_weights(tmp_path) -> None:
    eager = _ergo(tmp_path)
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
