"""``generate``'s KV cache counted before the first token (``generate_memory``): predicted where the
cache holds every position at every layer, refused before any weight is read when it cannot fit, and
planned for from the start when it can."""

from __future__ import annotations

import inspect
import shutil

import pytest
import torch
import transformers as tf

import fxoffload_hf
from fxoffload_hf.generate_memory import decode_step_bytes, final_kv_bytes, predictable_cache
from fxoffload_hf.kv_cache import kv_cache_bytes
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
    # the last new token is not fed back: 5 + 7 - 1 positions
    assert final_kv_bytes(model, (ids,), {"max_new_tokens": 7}) == 2 * 11 * per_position
    assert (
        final_kv_bytes(model, (), {"input_ids": ids, "max_new_tokens": 7, "num_beams": 3})
        == 6 * 11 * per_position
    )
    assert final_kv_bytes(model, (ids,), {"max_length": 9}) == 2 * 8 * per_position


def test_no_prediction_where_the_cache_holds_something_else(checkpoint_config):
    with torch.device("meta"):
        assert not predictable_cache(tf.T5ForConditionalGeneration(checkpoint_config("t5")))
        # no cache at all: each step runs the whole sequence again (its activations are measured per call)
        assert not predictable_cache(
            tf.OpenAIGPTLMHeadModel(tf.OpenAIGPTConfig(n_layer=2, n_embd=64, n_head=2))
        )
    # looped Inkling 2's layers (run again, with caches of their own) hold states not sized here; Gated
    # DeltaNet's, Mamba's, Mamba-2's, RG-LRU's, Zaya's, Inkling's and Lightning attention's are (below)
    hybrid = checkpoint_config("inkling2_loop")
    assert not predictable_cache(_tiny(hybrid))
    # the plan's figure for them stays an upper bound: every layer's keys and values at full attention
    # (2 layers, 2 sequences, keys and values of 1 head of 32, 100 positions, fp32)
    assert kv_cache_bytes(hybrid, 2, 100, 4) == 2 * 2 * 2 * 1 * 32 * 100 * 4
    assert predictable_cache(_tiny(checkpoint_config("llama")))
    assert predictable_cache(_tiny(_small(tf.Qwen3NextConfig, **GATED_DELTA_NET)))


def _small(config_class, **extra):
    return config_class(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, head_dim=16, **extra,
    )  # fmt: skip


# Gated DeltaNet layers: two key heads of 16, four value heads of 8, a kernel of 4; every other one
GATED_DELTA_NET = {
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "layer_types": ["linear_attention", "full_attention"] * 2,
}  # fmt: skip


MAMBA = {
    "hidden_size": 64, "intermediate_size": 128, "state_size": 8, "conv_kernel": 4, "time_step_rank": 8,
    "num_hidden_layers": 3, "vocab_size": 1000,
}  # fmt: skip


MAMBA2 = {"hidden_size": 64, "vocab_size": 1000}


def _latent(config_class, **extra):
    return config_class(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, kv_lora_rank=16, q_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, **extra,
    )  # fmt: skip


def test_latent_attention_is_predicted_for_generate_but_not_for_the_layers_bounds_and_caches():
    """A latent cache is predicted for ``generate`` (beside each decode step's latents expanded to every
    head), but the reserved cache and the cache on disk read keys and values per head: for them its
    layers are not predicted (``cache_positions``)."""
    from fxoffload_hf.kv_cache import cache_positions, latent_expansion_bytes

    config = _latent(tf.DeepseekV3Config)
    model = _tiny(config)
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert final_kv_bytes(model, (ids,), {"max_new_tokens": 7}) == 2 * 11 * 3 * (16 + 8) * 4
    assert predictable_cache(model) and cache_positions(config, 11) is None
    dense = decode_step_bytes(_tiny(_small(tf.LlamaConfig)), (ids,), {"max_new_tokens": 7})
    expansion = latent_expansion_bytes(config, 2, 11, 4)
    assert expansion == 2 * 11 * 4 * (2 * 16 + 8 + 2 * 16) * 4
    assert decode_step_bytes(model, (ids,), {"max_new_tokens": 7}) == dense + expansion


@pytest.mark.parametrize(
    "config",
    [
        _small(tf.LlamaConfig),
        _small(tf.MistralConfig, sliding_window=5),  # every layer over a window shorter than the call
        _small(tf.Gemma2Config, sliding_window=6),  # sliding and full layers in turn
        _small(tf.Gemma3TextConfig, sliding_window=4, sliding_window_pattern=2),
        # global layers with another head size than the sliding ones (a per-layer attribute)
        _small(tf.Gemma4TextConfig, sliding_window=4, global_head_dim=32),
        # the last two layers read the cache of earlier ones (they cache nothing themselves)
        _small(
            tf.Gemma4TextConfig, sliding_window=4, global_head_dim=32, num_kv_shared_layers=2,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
        # chunked attention over chunks shorter than the call, beside full-attention layers, routed experts
        _small(tf.Llama4TextConfig, attention_chunk_size=4, num_local_experts=2, intermediate_size_mlp=128),
        _latent(tf.DeepseekV3Config),  # latent attention: its compressed latents cached
        _latent(tf.DeepseekV32Config, index_head_dim=16, index_n_heads=2, index_topk=4),  # and indexer keys
        # Gated DeltaNet layers beside full attention: convolution and recurrent states of a fixed size
        _small(tf.Qwen3NextConfig, **GATED_DELTA_NET, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        _small(tf.OlmoHybridConfig, **GATED_DELTA_NET, pad_token_id=0),
        # Mamba layers: a convolution's and a scan's states of a fixed size
        tf.MambaConfig(**MAMBA),
        tf.FalconMambaConfig(**MAMBA),
        # beside attention layers and routed experts
        _small(
            tf.JambaConfig, mamba_d_state=8, mamba_expand=2, num_experts=4, num_experts_per_tok=2,
            attn_layer_period=2, attn_layer_offset=1, pad_token_id=0,
        ),
        # Mamba-2 layers (heads, groups, chunks), alone, or beside attention and MLP layers
        tf.Mamba2Config(**MAMBA2, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=8, n_groups=1, chunk_size=16),
        tf.NemotronHConfig(
            **MAMBA2, num_hidden_layers=3, hybrid_override_pattern="M*-", mamba_num_heads=8, mamba_head_dim=16,
            ssm_state_size=8, n_groups=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, chunk_size=16,
        ),
        tf.BambaConfig(
            **MAMBA2, num_hidden_layers=2, mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_n_groups=1,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, attn_layer_indices=[1],
            mamba_chunk_size=16, pad_token_id=0,
        ),
        # Mamba-2 and attention side by side in every layer
        tf.FalconH1Config(
            **MAMBA2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8,
            mamba_n_groups=1, mamba_chunk_size=16, pad_token_id=0,
        ),
    ],
    ids=[
        "full", "sliding", "alternating", "pattern", "per-layer-heads", "shared-layers", "chunked", "latent",
        "latent-indexed", "gated-delta-net", "gated-delta-net-olmo", "mamba", "falcon-mamba", "jamba", "mamba2",
        "nemotron-h", "bamba", "falcon-h1",
    ],
)  # fmt: skip
def test_the_prediction_is_the_cache_eager_generate_leaves(config):
    """What Transformers' own cache holds at the end of a greedy generate, byte for byte, for layers of
    full attention, sliding windows, both, layers of different head sizes, layers sharing another's
    cache, chunked attention, and latent attention (its latents, and an indexed layer's indexer keys)."""
    _assert_predicted_as_generate_leaves(config)


HYBRIDS = [
    "zamba", "zamba2", "granitemoehybrid", "lfm2", "lfm3", "kimi_linear", "bailing_hybrid", "minimax", "zaya",
    "inkling", "inkling2",
]  # fmt: skip


@pytest.mark.parametrize("arch", HYBRIDS)
def test_the_prediction_is_the_cache_of_hybrids(arch, checkpoint_config):
    """Shared attention blocks at Zamba's and Zamba 2's hybrid layers (Zamba's Mamba layers of two
    heads); Mamba-2 layers beside routed experts; LFM2's short convolutions beside attention; Kimi's delta
    attention beside latent attention; MiniMax's Lightning attention, whose state its own cache keeps; Zaya's
    convolutional attention (a convolution's inputs and a delayed half of the values beside keys and values);
    Inkling's and Inkling 2's four short convolutions per layer (fp32) beside keys and values, a window of them in sliding
    layers."""
    _assert_predicted_as_generate_leaves(checkpoint_config(arch))


def test_the_prediction_is_xlstms_cache(checkpoint_config):
    """xLSTM keeps its mLSTM layers' states (a matrix memory, its normaliser and stabiliser per head) in a
    cache of its own, in the model's dtype: predicted byte for byte as a greedy generate leaves it."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = tf.AutoModelForCausalLM.from_config(checkpoint_config("xlstm")).eval().to(dtype)
        ids = torch.randint(1, 1000, (3, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
        held = sum(t.nbytes for states in out.past_key_values.rnn_state.values() for t in states)
        assert final_kv_bytes(model, (ids,), {"max_new_tokens": 5}) == held > 0


def test_the_prediction_counts_states_kept_by_modules(checkpoint_config):
    """RecurrentGemma's RG-LRU layers keep their states in their modules (a recurrent state in fp32, the
    convolution's last inputs), its attention layers a window of keys and values in the cache: both are
    predicted, byte for byte, as a greedy generate leaves them."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = tf.AutoModelForCausalLM.from_config(checkpoint_config("recurrent_gemma")).eval().to(dtype)
        ids = torch.randint(1, 1000, (3, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=12, return_dict_in_generate=True, **GREEDY
            )  # past the window
        kept = [getattr(m, n, None) for m in model.modules() for n in ("recurrent_states", "conv1d_state")]
        cached = [t for layer in out.past_key_values.layers for t in (getattr(layer, "keys", None),)]
        cached += [getattr(layer, "values", None) for layer in out.past_key_values.layers]
        held = sum(t.nbytes for t in kept + cached if isinstance(t, torch.Tensor))
        assert final_kv_bytes(model, (ids,), {"max_new_tokens": 12}) == held > 0


def test_the_prediction_is_rwkvs_state():
    """RWKV keeps its state outside Transformers' caches: five tensors of every layer, two in the model's
    dtype and three in fp32, whatever the length; a generate's is predicted as a call leaves it."""
    config = tf.RwkvConfig(vocab_size=1000, hidden_size=64, attention_hidden_size=64, num_hidden_layers=3)
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model = tf.AutoModelForCausalLM.from_config(config).eval().to(dtype)
        ids = torch.randint(1, 1000, (3, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            held = sum(t.nbytes for t in model(ids, use_cache=True).state)
        assert final_kv_bytes(model, (ids,), {"max_new_tokens": 5}) == held > 0


def _assert_predicted_as_generate_leaves(config) -> None:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(1, 1000, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, return_dict_in_generate=True, **GREEDY)
    cache = out.past_key_values
    kept = ("keys", "values", "indexer_keys", "conv_states", "recurrent_states")
    found = [getattr(layer, name, None) for layer in cache.layers for name in kept]
    tensors = [t for f in found for t in (f.values() if isinstance(f, dict) else [f])]  # states by index
    tensors += [t for t in getattr(cache, "linear_cache", ()) if isinstance(t, torch.Tensor)]  # MiniMax's
    held = sum(t.nbytes for t in tensors if t is not None)
    assert final_kv_bytes(model, (ids,), {"max_new_tokens": 5}) == held > 0


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
    call = (ids,), {"max_new_tokens": 6}
    # the default cache is written in place (``reserved_cache``): a decode step holds it once
    assert engine.expected_activations == final_kv_bytes(model, *call) + decode_step_bytes(model, *call)


@pytest.mark.usefixtures("llama_layers_break_graphs")
def test_a_generate_whose_capture_stopped_midway_starts_again_as_eager_calls(
    tmp_path, save_checkpoint, default_capture, monkeypatch, second_graph_refused
):
    """A decode step captured for speed as two graphs (a graph break in its first layer) whose second is
    refused after the first ran cannot go on: its cache was extended. The generate, which made its own
    cache, starts again from its first token as eager calls: eager's tokens."""
    import fxoffload_hf.deferral

    eager = save_checkpoint("llama", tmp_path)
    ids = torch.randint(1, 1000, (1, 6), generator=torch.Generator().manual_seed(7))
    greedy = dict(max_new_tokens=4, **GREEDY)
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
    graphs = second_graph_refused
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="2MiB", device="cpu")
    engine = fxoffload_hf.engine_of(model)
    try:
        with torch.no_grad():
            assert torch.equal(model.generate(ids, **greedy), expected) and engine.stats.eager_calls == 4
            monkeypatch.setattr(fxoffload_hf.deferral, "_CAPTURE_SECONDS_PER_MODULE_CALL", 0.0)
            # its prefill decides to capture; the first decode step stops midway; it starts again
            assert torch.equal(model.generate(ids, **greedy), expected)
            assert len(graphs) == 2 and engine.deferral.refused and engine.deferring
            assert engine.stats.eager_calls == 4 + 1 + 4  # the prefill that decided, then all again
    finally:
        fxoffload_hf.restore(model)


def test_a_generate_given_a_cache_or_a_streamer_is_not_run_again(tmp_path, save_checkpoint):
    """Run again, a generate given its cache would extend it twice, and one given a streamer would stream
    its first tokens twice: stopped midway, they are refused."""
    from fxoffload_hf.generate_memory import counting_kv
    from fxoffload_hf.memory_model import CallStoppedMidway

    save_checkpoint("llama", tmp_path)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="2MiB", device="cpu")
    calls = []

    def stops_once(*args, **kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise CallStoppedMidway("stopped midway (a test's)", smallest_budget=1)
        return "tokens"

    stops_once.__signature__ = inspect.signature(model.generate)  # type: ignore[attr-defined]
    try:
        generate = counting_kv(model, stops_once, fxoffload_hf.engine_of(model))
        assert generate(max_new_tokens=2) == "tokens" and len(calls) == 2  # run again
        for args, given in [
            ((), {"streamer": object()}),
            ((None,) * 7 + (object(),), {}),  # a streamer in its place (generate's eighth argument)
            ((), {"cache": object()}),  # Transformers 5.25's name for a cache passed in
            ((), {"past_key_values": object()}),
            ((), {"state": object()}),  # RWKV's
        ]:
            calls.clear()
            with pytest.raises(CallStoppedMidway):
                generate(*args, max_new_tokens=2, **given)
            assert len(calls) == 1
    finally:
        fxoffload_hf.restore(model)
