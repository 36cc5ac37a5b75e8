"""activations: a graph's activation peak for the sizes of each call, equal to a capture at those sizes."""

from __future__ import annotations

import pytest
import torch

from fxoffload_hf.activations import activation_model
from fxoffload_hf.capture import capture_settings
from fxoffload_hf.graphs import activation_peak
from fxoffload_hf.weight_record import Tier


def _capture(model, args, dynamic):
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad(), capture_settings():  # as the engine captures
        torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)(*args)
    torch._dynamo.reset()
    return seen[0]


def _weights(gm, example_inputs):
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {
        n for n, v in zip(placeholders, example_inputs, strict=False) if isinstance(v, torch.nn.Parameter)
    }


def _call_args(gm, example_inputs, ids):
    """The graph's arguments for a call with ``ids``: its sizes where the graph takes sizes."""
    traced = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    position = next(
        i for i, v in enumerate(example_inputs) if isinstance(v, torch.Tensor) and v.dtype == torch.long
    )
    dims = {
        size.node.expr: d for d, size in enumerate(traced[position].shape) if isinstance(size, torch.SymInt)
    }
    args = list(example_inputs)
    args[position] = ids
    for i, value in enumerate(traced):
        if isinstance(value, torch.SymInt):
            args[i] = ids.shape[dims[value.node.expr]]
    return args


@pytest.mark.parametrize("batch, length", [(2, 7), (9, 7), (2, 40), (16, 33)])
def test_the_peak_for_a_call_equals_a_capture_at_its_sizes(build_model, batch, length):
    model = build_model("llama")
    small = torch.randint(0, 1000, (3, 5))
    gm, inputs = _capture(model, (small,), dynamic=True)
    weights = _weights(gm, inputs)
    at_capture = activation_peak(gm.graph, weights)
    estimate = activation_model(gm, weights, at_capture)
    assert estimate.peaks is not None  # sizes are symbols: not the capture's figure for every call

    big = torch.randint(0, 1000, (batch, length))
    static_gm, static_inputs = _capture(model, (big,), dynamic=False)
    expected = activation_peak(static_gm.graph, _weights(static_gm, static_inputs))
    assert estimate(_call_args(gm, inputs, big)) == expected
    assert estimate(_call_args(gm, inputs, small)) == at_capture


def test_a_later_call_with_more_activations_keeps_fewer_weights_and_stays_exact(llama_ckpt):
    import fxoffload_hf
    from fxoffload_hf.weight_record import Tier

    folder, eager = llama_ckpt
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=1_400_000, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    # neither has a size of 1 (dynamo would capture a graph of its own for it)
    small = torch.randint(0, 1000, (3, 6), generator=torch.Generator().manual_seed(3))
    large = torch.randint(0, 1000, (5, 19), generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad():
            model(small, use_cache=False)
            before = engine.activation_bytes[0]
            got = model(large, use_cache=False).logits
        after = engine.activation_bytes[0]
        kept = engine.store.bytes_in(Tier.MAPPED)
        graphs = len(engine.runners)
    finally:
        fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(got, eager(large, use_cache=False).logits)
    assert graphs == 1  # the same graph served both calls
    assert after > before  # measured for the larger call
    assert engine.memory.fits(activations=after, resident=kept)  # what stays resident left it room


def test_the_kv_cache_a_call_passes_is_counted_at_its_length(llama_ckpt):
    import fxoffload_hf

    folder, eager = llama_ckpt
    config = eager.config
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=1_400_000, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    ids = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        decode = min(engine.activation_bytes)  # a one-token step holds little beside the cache
        graphs = len(engine.runners)
    finally:
        fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(got, eager.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False))
    head_dim = config.hidden_size // config.num_attention_heads
    # keys and values of every layer, in fp32: the cache is reserved for the 45 positions the last step
    # writes (``reserved_cache``) and written in place, so a step holds it once, not the cache it is
    # passed beside the one it builds
    per_position = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    assert graphs == 2 and per_position * 45 <= decode < per_position * (44 + 45)


def test_a_growing_kv_cache_remakes_the_plan_a_few_times_per_generation_not_each_token(
    llama_ckpt, monkeypatch
):
    import fxoffload_hf

    folder, eager = llama_ckpt
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=1_400_000, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    replans = []
    replan = engine.replan
    monkeypatch.setattr(engine, "replan", lambda: (replans.append(1), replan())[1])
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(6))
    greedy = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False)
    try:
        with torch.no_grad():
            got = model.generate(ids, **greedy)
        planned = max(engine.activation_bytes)
        kept = engine.store.bytes_in(Tier.MAPPED)
    finally:
        fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(got, eager.generate(ids, **greedy))
    # each remade plan holds a quarter more than the call that outgrew the last: the cache grows about
    # sevenfold from the first decode step to the last, so a handful of plans, not one per token
    assert 0 < len(replans) <= 12, len(replans)
    assert engine.memory.fits(activations=planned, resident=kept)
