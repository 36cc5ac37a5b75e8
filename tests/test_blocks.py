"""Repeated blocks: traced once as nested compile regions, stamped out for the others, outputs exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxoffload_hf
from fxoffload_hf.blocks import BlockRegions, region_counts, repeated_blocks, stateless


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def test_repeated_blocks_are_the_alike_block_children_of_a_list():
    blocks = nn.ModuleList([Block(4), Block(4), Block(8), Block(4)])
    singles = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    model = nn.ModuleDict({"blocks": blocks, "singles": singles})
    # the odd-shaped block has no twin, and lists of single layers are not blocks
    assert list(repeated_blocks(model)) == [blocks[0], blocks[1], blocks[3]]
    blocks[1].forward = blocks[1].forward  # a forward of its own on the instance: left alone
    assert list(repeated_blocks(model)) == [blocks[0], blocks[3]]


def test_only_calls_without_state_go_through_the_region():
    t = torch.zeros(1)
    assert stateless((t, None, (t, t)), {"n": 3, "mode": "x", "eps": 1e-6})
    assert not stateless((t,), {"past_key_values": object()})
    assert not stateless(([t, {"k": t}],), {})


def test_marking_is_undone_whole():
    model = nn.Sequential(Block(4), Block(4))
    undo = BlockRegions().mark(model)
    assert all("forward" in b.__dict__ for b in model)
    for record in reversed(undo):
        record.undo()
    assert all("forward" not in b.__dict__ for b in model)


@pytest.mark.parametrize("layers", [2, 6])
def test_a_forward_without_cache_traces_one_block_whatever_the_depth(build_model, weight_bytes, layers):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_hidden_layers=layers,
        vocab_size=1000,
    )
    eager = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = eager(ids, use_cache=False).logits
    torch._dynamo.reset()
    model = fxoffload_hf.offload(eager, cpu_memory=weight_bytes(eager) // 3, device="cpu")
    try:
        with torch.no_grad():
            got = model(ids, use_cache=False).logits
        assert region_counts() == (1, layers - 1)
        assert fxoffload_hf.engine_of(model).report()["pieces"][0] > layers  # cut inside blocks too
    finally:
        fxoffload_hf.restore(model)
    assert torch.equal(got, expected)
    assert all("forward" not in layer.__dict__ for layer in eager.model.layers)


def test_a_block_dynamo_cannot_capture_as_a_region_is_captured_plain(weight_bytes):
    import transformers as tf

    torch.manual_seed(0)
    # T5's blocks return a tensor they were given (the position bias): dynamo refuses that in a region
    config = tf.T5Config(d_model=128, d_ff=256, num_heads=4, d_kv=32, num_layers=3, vocab_size=1000)
    eager = tf.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = eager(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits
    model = fxoffload_hf.offload(eager, cpu_memory=weight_bytes(eager) // 3, device="cpu")
    try:
        with torch.no_grad():
            got = model(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits
    finally:
        fxoffload_hf.restore(model)
    assert torch.equal(got, expected)
