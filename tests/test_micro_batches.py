"""generate on a batch whose KV cache cannot fit the budget whole runs in micro-batches as one block: each
micro-batch's tokens are eager's for it, bit for bit, instead of a refusal."""

from __future__ import annotations

import re

import pytest
import torch
from test_batched_generation import left_padded

import fxoffload_hf
from fxoffload_hf import BudgetTooSmallError

LENGTHS = (3, 9, 6, 12, 5, 7, 11, 4)
GREEDY = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)


# The cache is written in place (``reserved_cache``): every micro-batch holds its own whole, so splitting
# saves only what the running ones compute beside it, and the budgets that split lie just above the cache
@pytest.mark.parametrize(
    "arch, share, parts", [("llama", 0.4, 2), ("llama", 0.34, 4), ("gpt2", 0.53, 2), ("gpt2", 0.6, 2)]
)
def test_a_batch_too_large_for_the_budget_runs_in_micro_batches(
    arch, share, parts, build_model, weight_bytes, caplog
):
    eager = build_model(arch)
    ids, mask = left_padded(LENGTHS, seed=1)
    model = build_model(arch)
    fxoffload_hf.offload(model, cpu_memory=int(weight_bytes(model) * share))
    try:
        with pytest.warns(UserWarning, match="micro-batches") as warned:
            got = model.generate(ids, attention_mask=mask, **GREEDY)
        message = next(str(w.message) for w in warned if "micro-batches" in str(w.message))
        size = int(re.search(r"micro-batches of up to (\d+)", message).group(1))
        retries = re.findall(r"trying micro-batches of (\d+)", caplog.text)
        size = int(retries[-1]) if retries else size
        assert -(-len(LENGTHS) // size) == parts
        pieces = [
            eager.generate(ids[i : i + size], attention_mask=mask[i : i + size], **GREEDY)
            for i in range(0, len(LENGTHS), size)
        ]
        width = max(p.shape[1] for p in pieces)
        expected = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in pieces])
        assert torch.equal(got, expected)
        stats = fxoffload_hf.engine_of(model).stats
        assert stats.calls == parts * GREEDY["max_new_tokens"]  # a prefill and 39 decode steps each
        if parts > 2:  # micro-batches that fit together share graph runs
            assert stats.runs < stats.calls
    finally:
        fxoffload_hf.restore(model)


def test_outputs_that_cannot_be_merged_are_refused_as_before(build_model, weight_bytes):
    model = build_model("llama")
    fxoffload_hf.offload(model, cpu_memory=int(weight_bytes(model) * 0.4))
    ids, mask = left_padded(LENGTHS, seed=1)
    try:
        with pytest.raises(BudgetTooSmallError, match="too small for this model"):
            model.generate(ids, attention_mask=mask, return_dict_in_generate=True, **GREEDY)
        assert fxoffload_hf.engine_of(model).stats.calls == 0
    finally:
        fxoffload_hf.restore(model)
