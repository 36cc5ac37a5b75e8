"""generate's default KV cache written in place into storage reserved for its final length: tokens and
scores equal the concatenating cache's bit for bit, eagerly and captured; a decode step holds it once."""

from __future__ import annotations

import copy

import pytest
import torch
from test_batched_generation import left_padded
from transformers.cache_utils import DynamicCache, DynamicLayer

import fxoffload_hf
from fxoffload_hf.reserved_cache import ReservedLayer, reserve_default_cache, reserves

LENGTHS = (3, 9, 6, 12)
GREEDY = dict(do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)


def _equal(got, expected) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))


def _model(arch: str, build_model):
    if arch in ("llama", "gpt2"):
        return build_model(arch)
    import transformers as tf
    from conftest import checkpoint_config

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(checkpoint_config(arch)).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "opt"])
@pytest.mark.parametrize(
    "settings",
    [
        dict(max_new_tokens=9),
        dict(max_new_tokens=5, num_beams=3),
        dict(max_new_tokens=7, num_return_sequences=2),
    ],
    ids=["greedy", "beams", "returned"],
)
def test_a_reserved_cache_gives_the_concatenating_caches_tokens_and_scores(arch, settings, build_model):
    """On the model itself, eagerly: the reservation alone changes nothing (beam search gives it up at its
    first reordering, as any reshaping of the cache does)."""
    model = _model(arch, build_model)
    ids, mask = left_padded(LENGTHS, seed=3)
    extra = dict(settings, do_sample=False)
    if settings.get("num_return_sequences"):
        extra.update(do_sample=True, top_k=5)
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model.generate(ids, attention_mask=mask, **{**GREEDY, **extra})
        model._prepare_cache_for_generation = reserve_default_cache(
            model._prepare_cache_for_generation, torch.device("cpu")
        )
        torch.manual_seed(1)
        got = model.generate(ids, attention_mask=mask, **{**GREEDY, **extra})
    _equal(got, expected)
    kinds = {type(layer) for layer in got.past_key_values.layers}
    assert kinds == {ReservedLayer}


@pytest.mark.parametrize("capture", ["first-call", "deferred"])
def test_offloaded_generate_reserves_its_cache_and_keeps_two_graphs(capture, build_model, weight_bytes):
    eager = build_model("llama")
    model = build_model("llama")
    fxoffload_hf.offload(model, cpu_memory=int(weight_bytes(model) * 0.6), capture=capture)
    engine = fxoffload_hf.engine_of(model)
    try:
        # other prompt lengths and numbers of new tokens reuse the graphs: the capacity is a size, not a
        # number the graph is specialised on
        for seed, lengths, new in [(1, LENGTHS, 8), (2, (5, 17, 2), 5), (3, (4, 4, 11, 7, 9), 12)]:
            ids, mask = left_padded(lengths, seed=seed)
            with torch.no_grad():
                got = model.generate(ids, attention_mask=mask, max_new_tokens=new, **GREEDY)
                expected = eager.generate(ids, attention_mask=mask, max_new_tokens=new, **GREEDY)
            _equal(got, expected)
            assert {type(layer) for layer in got.past_key_values.layers} == {ReservedLayer}
        assert len(engine.runners) <= 2
    finally:
        fxoffload_hf.restore(model)
    assert "_prepare_cache_for_generation" not in model.__dict__


def test_a_cache_the_caller_passes_and_sliding_windows_are_left_as_they_are(build_model, weight_bytes):
    model = build_model("llama")
    fxoffload_hf.offload(model, cpu_memory=int(weight_bytes(model) * 0.6))
    ids, mask = left_padded(LENGTHS, seed=4)
    try:
        own = DynamicCache(config=model.config)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, cache=own, **GREEDY)
        assert {type(layer) for layer in own.layers} == {DynamicLayer}
        assert not reserves(model, {"cache": own}, model.generation_config)
        assert reserves(model, {}, model.generation_config)
        beams = copy.deepcopy(model.generation_config)
        beams.num_beams = 3
        assert not reserves(model, {}, beams)  # its first reordering gives the reservation up
    finally:
        fxoffload_hf.restore(model)
    windowed = build_model("llama")
    windowed.config.layer_types = ["sliding_attention", "full_attention"] * 2
    windowed.config.sliding_window = 4
    fxoffload_hf.offload(windowed, cpu_memory=int(weight_bytes(windowed) * 0.6))
    try:
        assert not reserves(windowed, {}, windowed.generation_config)
    finally:
        fxoffload_hf.restore(windowed)


@pytest.mark.parametrize("views", [True, False], ids=["views", "copies"])
def test_a_layer_written_past_its_reservation_concatenates_as_transformers_does(views: bool) -> None:
    layer, plain = ReservedLayer(4, torch.device("cpu")), DynamicLayer()
    layer._views = views  # copies: what a CUDA layer hands attention
    generator = torch.Generator().manual_seed(0)
    for length in (3, 1, 2, 1):
        keys, values = (torch.randn(2, 2, length, 8, generator=generator) for _ in range(2))
        got, expected = layer.update(keys, values), plain.update(keys, values)
        for a, b in zip(got, expected, strict=True):
            assert torch.equal(a, b) and (views or a.stride() == b.stride())
    assert layer.get_seq_length() == plain.get_seq_length() == 7
    assert layer._key_store is None  # given up at the update that did not fit
