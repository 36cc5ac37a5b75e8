"""Repeated blocks: traced once as nested compile regions, stamped out for the others, outputs exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxoffload_hf
from fxoffload_hf.blocks import (
    BlockRegions,
    _NoKernelFunctions,
    _stateless_kernel_dispatch,
    region_counts,
    repeated_blocks,
    stateless,
)
from fxoffload_hf.capture import compile_entry


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
    blocks[0].forward = blocks[0].forward  # its class's forward, bound on the instance: still alike
    blocks[1].forward = lambda x: x  # another forward on the instance: left alone
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


def _captured(model, *args, **kwargs):
    """``model`` called through ``compile_entry`` with its blocks marked, as ``plan`` captures it: the
    output, and the blocks traced and stamped out."""
    regions = BlockRegions()
    undo = regions.mark(model)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            out = compile_entry(model.forward, lambda gm, _: gm.forward, regions)(*args, **kwargs)
        counts = region_counts()
    finally:
        torch._dynamo.reset()
        for record in reversed(undo):
            record.undo()
    return out, counts, regions.enabled


@pytest.mark.parametrize("layers", [2, 6])
def test_a_forward_without_cache_traces_one_block_whatever_the_depth(layers):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_hidden_layers=layers,
        vocab_size=1000,
    )
    model = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    out, counts, _ = _captured(model, ids, use_cache=False)
    assert counts == (1, layers - 1)
    assert torch.equal(out.logits, expected)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)


def _llama_with_kernel_functions():
    import transformers as tf

    kernels_layer = pytest.importorskip("kernels._internals.layer.layer")
    config = tf.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2, vocab_size=100
    )
    model = tf.LlamaForCausalLM(config).eval()
    if not any("_kernel_funcs" in m.__dict__ for m in model.modules()):
        pytest.skip("this Transformers does not route functions through the kernels package")
    return kernels_layer, model


def test_the_kernels_registry_is_held_empty_while_blocks_are_marked_and_given_back():
    # Transformers 5.25 with `kernels` installed: the registry's writes are side effects that keep
    # dynamo from stamping out blocks (the depth test above covers the counts)
    kernels_layer, model = _llama_with_kernel_functions()
    registry = kernels_layer._ACTIVE_KERNEL_FUNCS
    undo = BlockRegions().mark(model)
    try:
        assert isinstance(kernels_layer._ACTIVE_KERNEL_FUNCS, _NoKernelFunctions)
        assert _stateless_kernel_dispatch(model) == []  # a second plan meanwhile leaves it alone
    finally:
        for record in reversed(undo):
            record.undo()
    assert kernels_layer._ACTIVE_KERNEL_FUNCS is registry


def test_a_kernelized_function_keeps_its_dispatch():
    kernels_layer, model = _llama_with_kernel_functions()
    registry = kernels_layer._ACTIVE_KERNEL_FUNCS
    attention = next(m for m in model.modules() if "_kernel_funcs" in m.__dict__)
    function = next(iter(attention._kernel_funcs.values()))
    function.forward = lambda *args, **kwargs: None  # what kernelize does: another forward on the instance
    undo = BlockRegions().mark(model)
    try:
        assert kernels_layer._ACTIVE_KERNEL_FUNCS is registry
    finally:
        for record in reversed(undo):
            record.undo()


def test_a_block_dynamo_cannot_capture_as_a_region_is_captured_plain():
    import transformers as tf

    torch.manual_seed(0)
    # T5's blocks return a tensor they were given (the position bias): dynamo refuses that in a region
    config = tf.T5Config(d_model=128, d_ff=256, num_heads=4, d_kv=32, num_layers=3, vocab_size=1000)
    model = tf.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids, decoder_input_ids=ids, use_cache=False).logits
    out, _, enabled = _captured(model, input_ids=ids, decoder_input_ids=ids, use_cache=False)
    assert not enabled  # given up
    assert torch.equal(out.logits, expected)


def test_offloaded_models_do_not_stamp_out_blocks(weight_bytes):
    # dynamo's reuse check let a wrong trace through on one architecture: the engine, where outputs
    # must equal eager's, traces every block
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_hidden_layers=3, vocab_size=1000
    )
    model = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    fxoffload_hf.offload(model, cpu_memory=weight_bytes(model) // 2, device="cpu")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
        assert region_counts() == (0, 0)
    finally:
        fxoffload_hf.restore(model)
