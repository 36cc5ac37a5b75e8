"""``generate``'s KV cache counted before the first token (``generate_memory``): predicted where the
cache holds every position at every layer, refused before any weight is read when it cannot fit, and
planned for from the start when it can."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers as tf

import fxoffload_hf
from fxoffload_hf.generate_memory import final_kv_bytes, full_attention_cache
from fxoffload_hf.memory_model import BudgetTooSmallError

BUDGET = 1_300_000  # the tiny Llama in several pieces, with room for a short generate's cache
GREEDY = dict(do_sample=False, pad_token_id=0)


def _tiny(config):
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config)


def test_the_final_cache_is_predicted_for_the_batch_beams_and_length(checkpoint_config):
    model = _tiny(checkpoint_config("llama"))  # 3 layers, 2 key/value heads of 32
    ids = torch.zeros(2, 5, dtype=torch.long)
    per_position = 2 * 3 * 2 * 32 * 4  # keys and values, layers, heads, head size, fp32
    assert final_kv_bytes(model, (ids,), {"max_new_tokens": 7}) == 2 * 12 * per_position
    assert (
        final_kv_bytes(model, (), {"input_ids": ids, "max_new_tokens": 7, "num_beams": 3})
        == 6 * 12 * per_position
    )
    assert final_kv_bytes(model, (ids,), {"max_length": 9}) == 2 * 9 * per_position


def test_no_prediction_where_the_cache_holds_something_else(checkpoint_config):
    sliding = _tiny(tf.MistralConfig(**{**checkpoint_config("mistral").to_dict(), "sliding_window": 4}))
    assert not full_attention_cache(sliding)
    assert final_kv_bytes(sliding, (torch.zeros(1, 5, dtype=torch.long),), {"max_new_tokens": 7}) == 0
    with torch.device("meta"):
        assert not full_attention_cache(tf.T5ForConditionalGeneration(checkpoint_config("t5")))
        # no cache at all: each step runs the whole sequence again (its activations are measured per call)
        assert not full_attention_cache(
            tf.OpenAIGPTLMHeadModel(tf.OpenAIGPTConfig(n_layer=2, n_embd=64, n_head=2))
        )
    assert full_attention_cache(_tiny(checkpoint_config("llama")))


@pytest.fixture
def offloaded(llama_master, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(llama_master[0], folder)
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=BUDGET, device="cpu")
    yield model, llama_master[1]
    fxoffload_hf.restore(model)


def test_a_cache_that_cannot_fit_is_refused_before_any_weight_is_read(offloaded):
    model, eager = offloaded
    engine = fxoffload_hf.engine_of(model)
    ids = torch.randint(2, 1000, (4, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(BudgetTooSmallError, match="KV cache reaches .* at its last token") as refused:
        model.generate(ids, max_new_tokens=400, **GREEDY)
    assert refused.value.smallest_budget > BUDGET
    assert engine.runners == [] and engine.stats.bytes_streamed == 0 and engine.stats.calls == 0
    # the refusal leaves the model as it was: a generate that fits gives eager's tokens
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, **GREEDY)
        assert torch.equal(got, eager.generate(ids, max_new_tokens=6, **GREEDY))
    assert engine.expected_activations == final_kv_bytes(model, (ids,), {"max_new_tokens": 6})
