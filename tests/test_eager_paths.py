"""Transformers' eager algorithms inside offloaded calls (``eager_paths``): with masks read by value (as on
CUDA), SDPA is called as eager calls it (no mask and ``is_causal`` where the padding mask is all ones, the
mask where there is padding); either way logits, tokens and scores equal eager's bit for bit on the CPU."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_batched_generation import GREEDY, assert_same_generation, left_padded
from torch import fx

import fxoffload_hf
from fxoffload_hf import eager_paths

BUDGET = 1_300_000  # several pieces of the tiny Llama, most weights on disk


def sdpa_calls(model) -> list[dict]:
    """The keyword arguments of every SDPA call in the offloaded model's captured pieces."""
    calls = []
    for runner in fxoffload_hf.engine_of(model).runners:
        for step in runner.program.steps:
            if isinstance(step.fn, fx.GraphModule):
                for node in step.fn.graph.nodes:
                    if node.target is torch.nn.functional.scaled_dot_product_attention:
                        calls.append(node.kwargs)
    return calls


@pytest.mark.parametrize("by_value", [True, False])
def test_sdpa_masks_follow_eager_when_read_by_value(llama_master, tmp_path, monkeypatch, by_value):
    folder = tmp_path / "llama"
    shutil.copytree(llama_master[0], folder)
    eager = llama_master[1]
    unpadded = torch.randint(2, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    padded, mask = left_padded((3, 9, 6), seed=4)
    if by_value:
        monkeypatch.setattr(
            eager_paths, "inside", lambda masks_by_value=False, inside=eager_paths.inside: inside(True)
        )
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=BUDGET, device="cpu")
    try:
        with torch.no_grad():
            # a forward with the all-ones mask a tokenizer gives (``generate`` drops such a mask itself)
            ones = torch.ones_like(unpadded)
            assert torch.equal(
                model(unpadded, attention_mask=ones).logits, eager(unpadded, attention_mask=ones).logits
            )
            unpadded_calls = sdpa_calls(model)
            got = model.generate(padded, attention_mask=mask, **GREEDY)
            expected = eager.generate(padded, attention_mask=mask, **GREEDY)
            assert_same_generation(got, expected)
        masked = [call for call in sdpa_calls(model) if call.get("attn_mask") is not None]
    finally:
        fxoffload_hf.restore(model)
    assert unpadded_calls and masked  # the padded batch passes its mask either way
    no_mask = [call.get("attn_mask") is None for call in unpadded_calls]
    # by value: eager's choice, SDPA without a mask and ``is_causal``; else a mask (the same bits on the CPU)
    assert all(no_mask) if by_value else not any(no_mask), unpadded_calls
    assert all(call.get("is_causal") is by_value for call in unpadded_calls)


def test_no_causal_mask_is_built_where_eager_builds_none_even_if_dynamo_says_exporting(
    llama_master, tmp_path, monkeypatch
):
    """Before torch 2.14 dynamo traces ``torch.compiler.is_exporting()`` as True, and Transformers then
    builds an explicit causal mask under capture where eager sets SDPA's ``is_causal`` (other rounding on
    CUDA). Simulated here: an offloaded call still takes eager's way, also where another model was offloaded
    before the function was patched (the replacement then in place is put there again, asking the patch)."""
    from transformers import masking_utils

    before = fxoffload_hf.offload(torch.nn.Linear(64, 64), cpu_memory="1MiB", device="cpu")
    try:
        monkeypatch.setattr(masking_utils, "is_torchdynamo_exporting", torch.compiler.is_compiling)
        folder = tmp_path / "llama"
        shutil.copytree(llama_master[0], folder)
        ids = torch.randint(2, 1000, (1, 9), generator=torch.Generator().manual_seed(5))
        model = fxoffload_hf.from_pretrained(folder, cpu_memory=BUDGET, device="cpu")
        try:
            with torch.no_grad():
                assert torch.equal(model(ids).logits, llama_master[1](ids).logits)
            calls = sdpa_calls(model)
        finally:
            fxoffload_hf.restore(model)
        assert calls and all(
            call.get("attn_mask") is None and call.get("is_causal") is True for call in calls
        )
        # the patch stays: asked by the replacement while a model is offloaded
        in_place = masking_utils.is_torchdynamo_exporting
        assert getattr(in_place, "__wrapped__", in_place) is torch.compiler.is_compiling
    finally:
        fxoffload_hf.restore(before)
    # and in place once none is (a model of another test on this worker may still be offloaded)
    assert masking_utils.is_torchdynamo_exporting is torch.compiler.is_compiling or eager_paths._users
