"""eager_memory: the bound on an eager call's activations is at least what a captured graph of the same
call measures, on real architectures, for forwards and each step of generate; calls it cannot read have
no bound."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.initialization import no_init_weights

import fxoffload_hf
from fxoffload_hf import weight_rescaling
from fxoffload_hf.eager_memory import eager_call_bytes
from fxoffload_hf.graph_entry import GraphEntry


@pytest.mark.parametrize("arch", ["llama", "gpt2", "opt", "t5", "deepseek_v3", "deepseek_v32"])
def test_the_bound_covers_what_each_captured_call_holds(arch, tmp_path, save_checkpoint, monkeypatch):
    eager = save_checkpoint(arch, tmp_path)
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    auto = transformers.AutoModelForSeq2SeqLM if arch == "t5" else None
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2 * weights, device="cpu", auto_class=auto)
    measured: list[int] = []
    bounds: list[int | None] = []
    run_one = GraphEntry._call_one

    def measuring(entry, args, held=0):
        measured.append(entry.activations(args))
        return run_one(entry, args, held)

    monkeypatch.setattr(GraphEntry, "_call_one", measuring)
    forward = model.forward

    def bounded(*args, **kwargs):
        bounds.append(eager_call_bytes(model, args, kwargs))
        return forward(*args, **kwargs)

    model.forward = bounded
    # a forward of one short sequence, then a batch of longer ones (each a graph of its own); T5: the
    # whole call, and the decoder's given the encoder's states
    short, batch = (
        torch.randint(1, 1000, shape, generator=torch.Generator().manual_seed(9))
        for shape in [(1, 9), (3, 40)]
    )
    try:
        with torch.no_grad():
            if arch == "t5":
                model(input_ids=short, decoder_input_ids=short[:, :5])
                model(input_ids=batch, decoder_input_ids=batch[:, :5])
                model(
                    encoder_outputs=(eager.encoder(input_ids=batch).last_hidden_state,),
                    decoder_input_ids=batch[:, :7],
                )
            else:
                model(short)
                model.generate(batch, max_new_tokens=3, do_sample=False)  # its prefill and decode steps
        assert len(bounds) == len(measured) >= 3  # a graph each: forwards, prefill and decode steps
        for bound, need in zip(bounds, measured, strict=True):
            assert bound is not None and bound >= need
    finally:
        del model.forward
        fxoffload_hf.restore(model)


def test_calls_the_bound_cannot_read_have_none(build_model, checkpoint_config):
    llama = build_model("llama")
    ids = torch.ones(2, 5, dtype=torch.long)
    assert eager_call_bytes(llama, (ids,), {}) == eager_call_bytes(llama, (), {"input_ids": ids})
    assert eager_call_bytes(llama, (ids,), {"use_cache": True, "output_hidden_states": False}) is not None
    # other inputs than token ids or their embeddings, a second positional argument
    assert eager_call_bytes(llama, (), {"inputs_embeds": torch.ones(2, 5, 128)}) is not None
    assert eager_call_bytes(llama, (), {"inputs_embeds": torch.ones(2, 5)}) is None  # not embeddings
    assert eager_call_bytes(llama, (), {"inputs_embeds": [torch.ones(2, 5, 128)]}) is None
    assert eager_call_bytes(llama, (), {"pixel_values": torch.ones(2, 3, 8, 8), "input_ids": ids}) is None
    assert eager_call_bytes(llama, (ids, ids), {}) is None
    assert eager_call_bytes(llama, (ids[0],), {}) is None  # not a batch of token ids
    assert eager_call_bytes(llama, (ids,), {"state": [torch.zeros(2, 128, 3)]}) is None  # RWKV's name only
    assert eager_call_bytes(build_model("mlp"), (torch.ones(2, 256),), {}) is None  # no config
    # layers other than attention beside attention whose kernels the bound does not read: looped Inkling 2's
    # (its layers run again, with caches of their own; a tiny Falcon-H1's Mamba-2 layers held 465 MiB against a dense bound of 0.04 MiB before
    # their own term, ``linear_attention``)
    with torch.device("meta"):
        hybrid = transformers.AutoModelForCausalLM.from_config(checkpoint_config("inkling2_loop"))
    assert eager_call_bytes(hybrid, (ids,), {}, "cpu") is None
    # attention whose heads the config does not state (latents are cached without them; the scores are not
    # bounded): only a model of linear-attention layers alone may have none
    with torch.device("meta"):
        latent = transformers.AutoModelForCausalLM.from_config(checkpoint_config("deepseek_v3"))
    assert eager_call_bytes(latent, (ids,), {}, "cpu") is not None
    latent.config.num_attention_heads = 0
    assert eager_call_bytes(latent, (ids,), {}, "cpu") is None
    # routed experts whose eager code copies expert weights (batched_mm gathers one per routed token), a
    # stacked weight outside Transformers' experts modules: captured, where what they hold is measured
    config = checkpoint_config("mixtral")
    assert eager_call_bytes(transformers.MixtralForCausalLM(config), (ids,), {}) is not None
    config._experts_implementation = "batched_mm"
    assert eager_call_bytes(transformers.MixtralForCausalLM(config), (ids,), {}) is None
    config._experts_implementation = "grouped_mm"
    mixtral = transformers.MixtralForCausalLM(config)
    mixtral.model.norm.register_parameter("stacked", torch.nn.Parameter(torch.zeros(2, 2, 2)))
    assert eager_call_bytes(mixtral, (ids,), {}) is None


def test_a_multimodal_models_text_only_call_is_bounded():
    """``generate`` passes a vision-language model's text-only calls ``mm_encoder_outputs={}``: bounded as
    the call without it; with an image's encoded states it holds more, and has no bound."""
    config = transformers.Gemma3Config(
        text_config={
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
        },
        vision_config={
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        },
    )  # fmt: skip
    with torch.device("meta"):
        gemma3 = transformers.Gemma3ForConditionalGeneration(config)
    ids = torch.ones(2, 5, dtype=torch.long)
    text_only = eager_call_bytes(gemma3, (ids,), {"mm_encoder_outputs": {}}, "cpu")
    assert text_only is not None and text_only == eager_call_bytes(gemma3, (ids,), {}, "cpu")
    image = {"image": torch.ones(2, 4, 128)}
    assert eager_call_bytes(gemma3, (ids,), {"mm_encoder_outputs": image}, "cpu") is None


def test_the_bound_grows_with_the_batch_and_the_cache(build_model):
    llama = build_model("llama")
    one = eager_call_bytes(llama, (torch.ones(1, 8, dtype=torch.long),), {})
    four = eager_call_bytes(llama, (torch.ones(4, 8, dtype=torch.long),), {})
    assert one is not None and four is not None and four >= 4 * one
    cache = transformers.DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(torch.ones(1, 30, dtype=torch.long), past_key_values=cache)
    step = torch.ones(1, 1, dtype=torch.long)
    later = eager_call_bytes(llama, (), {"input_ids": step, "past_key_values": cache})
    first = eager_call_bytes(llama, (step,), {})
    assert later is not None and first is not None and later > first


def _vocab_heavy(kind: str, dtype: torch.dtype, attention: str, checkpoint_config) -> torch.nn.Module:
    """A model whose output head and its loss outweigh the rest of a call (vocabulary 32,000, hidden 256):
    the suite's vocabulary-heavy Llama and GPT-2, and a T5 of that shape."""
    if kind == "t5":
        config = transformers.T5Config(
            vocab_size=32000,
            d_model=256,
            d_ff=512,
            d_kv=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        )
    else:
        config = checkpoint_config(f"{kind}-vocab-heavy")
    auto = transformers.AutoModelForSeq2SeqLM if kind == "t5" else transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    return auto.from_config(config, attn_implementation=attention).eval().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kind", "attention"), [("llama", "sdpa"), ("llama", "eager"), ("gpt2", "eager"), ("t5", "sdpa")]
)
def test_the_bound_covers_a_loss_and_every_layers_states(kind, attention, dtype, checkpoint_config):
    """A loss over the labels (an evaluation's perplexity: the log-probabilities of every position beside
    the upcast logits), every layer's hidden states and attention probabilities kept to be returned: at
    least what the allocator's peak shows each call hold. An encoder-decoder given labels alone decodes
    them shifted."""
    model = _vocab_heavy(kind, dtype, attention, checkpoint_config)
    generator = torch.Generator().manual_seed(3)
    ids, labels = (torch.randint(3, 32000, (3, 40), generator=generator) for _ in range(2))
    decoder = {"decoder_input_ids": labels[:, :9]} if kind == "t5" else {}  # T5 without labels
    calls = [
        {"labels": labels},
        {"output_hidden_states": True, **decoder},
        {"labels": labels, "output_hidden_states": True},
    ]
    if attention == "eager":
        calls.append({"output_attentions": True, **decoder})
    with torch.no_grad():
        for kwargs in calls:
            bound = eager_call_bytes(model, (), {"input_ids": ids, **kwargs}, "cpu")
            assert bound is not None and bound >= _eager_peak(model, input_ids=ids, **kwargs), kwargs
    plain = eager_call_bytes(model, (), {"input_ids": ids}, "cpu")
    with_loss = eager_call_bytes(model, (), {"input_ids": ids, "labels": labels}, "cpu")
    assert plain is not None and with_loss is not None and with_loss > plain


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_the_bound_covers_a_call_on_embeddings(kind, checkpoint_config):
    """A call given the tokens' embeddings (soft prompts; a multimodal model's merged inputs) holds what
    the same call on token ids holds: bounded alike, at least the allocator's peak, with labels too."""
    model = _vocab_heavy(kind, torch.float32, "sdpa", checkpoint_config)
    ids, labels = (
        torch.randint(3, 32000, (2, 24), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )
    embeddings = model.get_input_embeddings()
    with torch.no_grad():
        embedded = {"inputs_embeds": embeddings(ids)}
        if kind == "t5":
            embedded["decoder_inputs_embeds"] = embeddings(labels[:, :7])
        by_ids = {"input_ids": ids, **({"decoder_input_ids": labels[:, :7]} if kind == "t5" else {})}
        assert eager_call_bytes(model, (), embedded, "cpu") == eager_call_bytes(model, (), by_ids, "cpu")
        for kwargs in (embedded, {"inputs_embeds": embedded["inputs_embeds"], "labels": labels}):
            bound = eager_call_bytes(model, (), kwargs, "cpu")
            assert bound is not None and bound >= _eager_peak(model, **kwargs), list(kwargs)


def test_a_configs_own_switch_to_keep_every_layers_states_counts_as_the_keyword(build_model):
    llama = build_model("llama")
    ids = torch.ones(2, 7, dtype=torch.long)
    plain = eager_call_bytes(llama, (ids,), {})
    keyword = eager_call_bytes(llama, (ids,), {"output_hidden_states": True})
    assert plain is not None and keyword is not None and keyword > plain
    llama.config.output_hidden_states = True
    assert eager_call_bytes(llama, (ids,), {}) == keyword
    assert eager_call_bytes(llama, (ids,), {"output_hidden_states": False}) == plain


def test_bf16_on_the_cpu_counts_a_products_scratchpad_per_thread(build_model):
    """oneDNN's bf16 products on the CPU take a scratchpad per thread (none in fp32, none on CUDA): a bf16
    model whose first parameters are kept in fp32 counts it too."""
    llama = build_model("llama").to(torch.bfloat16)
    llama.model.embed_tokens.float()
    ids = (torch.ones(1, 8, dtype=torch.long),)
    on_cpu, on_cuda = eager_call_bytes(llama, ids, {}), eager_call_bytes(llama, ids, {}, "cuda")
    assert on_cpu is not None and on_cuda is not None
    assert on_cpu - on_cuda == 256 * 1024 * torch.get_num_threads()
    fp32 = build_model("llama")
    assert eager_call_bytes(fp32, ids, {}) == eager_call_bytes(fp32, ids, {}, "cuda")


def _eager_peak(model: torch.nn.Module, *args, **kwargs) -> int:
    """The most bytes of tensors ``model(*args, **kwargs)`` allocated at once (those alive before it not
    counted), from the CPU allocator's events: copies inside a kernel included."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfileTimeline

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        model(*args, **kwargs)
    # a key created again before it was destroyed is one allocation replacing another (the profiler keys
    # allocations by storage, and may miss the free between them: counted twice, a decode step's peak read
    # 2.9 MB where 0.33 MB were alive)
    sizes: dict = {}
    live = peak = 0
    for _time, action, key, size in MemoryProfileTimeline(prof._memory_profile()).timeline:
        if action == Action.CREATE:
            live += size - sizes.get(key, 0)
            sizes[key] = size
        elif action == Action.DESTROY:
            live -= sizes.pop(key, size)
        peak = max(peak, live)
    return peak


def _moe(arch: str, checkpoint_config) -> torch.nn.Module:
    small = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    if arch == "mixtral":
        config = checkpoint_config("mixtral")
    elif arch == "qwen3_moe":  # many experts, several per token, a width of their own
        config = transformers.Qwen3MoeConfig(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_experts=16,
            num_experts_per_tok=4, **small,
        )  # fmt: skip
    elif arch == "llama4":  # experts of its own: every token through every expert; chunked attention
        config = transformers.Llama4TextConfig(
            hidden_size=128, intermediate_size=256, intermediate_size_mlp=256, num_local_experts=16,
            attention_chunk_size=16, **small,
        )  # fmt: skip
    else:  # gpt_oss: stacked weights stored transposed, with biases
        config = transformers.GptOssConfig(
            hidden_size=128, intermediate_size=128, num_local_experts=8, **small
        )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "gpt_oss", "llama4"])
def test_the_bound_covers_what_routed_experts_hold_eagerly(arch, checkpoint_config):
    """Measured from the allocator (copies inside kernels too), for Transformers' default experts
    implementation and its eager one (Llama 4's experts have code of their own): prefills of a batch,
    and a decode step with its cache."""
    for implementation in ("grouped_mm", "eager"):
        model = _moe(arch, checkpoint_config)
        model.config._experts_implementation = implementation
        for tokens in (1, 33):
            _assert_bounds_cover_prefill_and_step(model, 2, tokens)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "switch_transformers"])
def test_the_bound_covers_a_call_returning_router_logits(arch, checkpoint_config):
    """A mixture of experts asked for its router logits (and, with labels, their auxiliary loss) keeps
    every layer's: at least the allocator's peak, above the call that does not ask; asked by the config's
    own switch alike. Switch Transformers' loss one-hot encodes every layer's choices."""
    if arch == "switch_transformers":
        config = transformers.SwitchTransformersConfig(
            vocab_size=1000, d_model=128, d_ff=256, d_kv=32, num_heads=4, num_layers=4, num_decoder_layers=4,
            num_sparse_encoder_layers=2, num_sparse_decoder_layers=2, num_experts=16, decoder_start_token_id=0,
        )  # fmt: skip
        torch.manual_seed(0)
        model = transformers.SwitchTransformersForConditionalGeneration(config).eval()
    else:
        model = _moe(arch, checkpoint_config)
    ids = torch.randint(3, 1000, (2, 48), generator=torch.Generator().manual_seed(4))
    decoder = {"decoder_input_ids": ids[:, :9]} if arch == "switch_transformers" else {}
    with torch.no_grad():
        for kwargs in (
            {"output_router_logits": True, **decoder},
            {"output_router_logits": True, "labels": ids},
        ):
            bound = eager_call_bytes(model, (ids,), kwargs, "cpu")
            assert bound is not None and bound >= _eager_peak(model, ids, **kwargs), list(kwargs)
    asked = eager_call_bytes(model, (ids,), {"output_router_logits": True, **decoder}, "cpu")
    plain = eager_call_bytes(model, (ids,), {"output_router_logits": False, **decoder}, "cpu")
    assert asked is not None and plain is not None and asked > plain
    model.config.output_router_logits = True
    assert eager_call_bytes(model, (ids,), decoder, "cpu") == asked


@pytest.mark.parametrize("pattern", ["M*-", "M*E"])
def test_experts_count_only_where_the_layers_route(pattern):
    """Nemotron-H's config keeps its mixture-of-experts variant's expert sizes whatever its layers: a
    pattern without ``E`` layers builds no experts, and their width does not move the bound; with them,
    it does."""
    ids = torch.zeros(2, 9, dtype=torch.long)
    bounds = []
    for width in (64, 7688):
        config = transformers.NemotronHConfig(
            hidden_size=128, vocab_size=1000, n_groups=1, chunk_size=16, num_hidden_layers=3,
            hybrid_override_pattern=pattern, mamba_num_heads=8, mamba_head_dim=32, ssm_state_size=16,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=width,
        )  # fmt: skip
        bounds.append(eager_call_bytes(transformers.AutoModelForCausalLM.from_config(config), (ids,), {}))
    assert None not in bounds
    assert (bounds[0] == bounds[1]) == ("E" not in pattern)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_bound_covers_latent_attention_over_long_prompts_in_any_precision(dtype, checkpoint_config):
    """Measured from the allocator: latent attention's keys are wider than its values, so attention runs
    its math kernel, which materialises scores and masks of queries x keys, and in bf16 computes in fp32
    (copies of every head's keys and values); a long prompt, then a step over its cache."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(checkpoint_config("deepseek_v3")).eval().to(dtype)
    _assert_bounds_cover_prefill_and_step(model, 1, 3000)


def test_the_bound_covers_gated_delta_net_at_its_real_head_sizes():
    """Measured from the allocator at Qwen3-Next's linear-attention head sizes (16 key and 32 value heads
    of 128), a prompt of eight chunks, then a decode step: the tiny models above have heads of 32."""
    config = transformers.Qwen3NextConfig(
        hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=1000, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    _assert_bounds_cover_prefill_and_step(
        transformers.AutoModelForCausalLM.from_config(config).eval(), 1, 512
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_bound_covers_mamba2_at_its_real_sizes(dtype):
    """Measured from the allocator at Mamba-2 130M's sizes (24 heads of 64, states of 128, chunks of 256),
    a prompt of two chunks and a half, then a decode step: the tiny models below have chunks of 16."""
    config = transformers.Mamba2Config(
        hidden_size=768, num_heads=24, head_dim=64, state_size=128, n_groups=1, chunk_size=256, expand=2,
        num_hidden_layers=2, vocab_size=1000,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)
    _assert_bounds_cover_prefill_and_step(model, 1, 640)


@pytest.mark.parametrize("hidden", [64, 768], ids=["tiny", "rwkv-169m"])
def test_the_bound_covers_rwkv(hidden):
    """Measured from the allocator: RWKV keeps its state outside Transformers' caches (``state``) and
    computes a prompt one position at a time; a batch's prompt, then a step given its state, fp32 and bf16,
    at a tiny width and RWKV-4 169M's. Its second block rescaled, as offloading makes it: the projection
    divides a copy of its weight at each call (``weight_rescaling``)."""
    config = transformers.RwkvConfig(
        vocab_size=1000, hidden_size=hidden, attention_hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=2, rescale_every=1,
    )  # fmt: skip
    model = _randomly_filled(config)  # RWKV's own initialisation takes 20 s at 768 wide
    weight_rescaling.divide_as_used(model, [])
    _assert_bounds_cover_own_state(model, 17, "state")


@pytest.mark.parametrize("hidden", [128, 1024], ids=["tiny", "wide"])
def test_the_bound_covers_xlstm(hidden, checkpoint_config):
    """Measured from the allocator: xLSTM keeps its mLSTM layers' states in a cache of its own
    (``xLSTMCache``) and runs a prompt through a chunkwise kernel; a batch's prompt longer than a chunk, then
    a step given its cache, fp32 and bf16, tiny and at hidden 1,024 (eight heads of 64 and 128)."""
    config = checkpoint_config("xlstm")
    config = transformers.xLSTMConfig(**{**config.to_dict(), "hidden_size": hidden, "embedding_dim": hidden})
    _assert_bounds_cover_own_state(_randomly_filled(config), 65, "cache")


def _randomly_filled(config) -> torch.nn.Module:
    """A model of ``config``, in eval mode, its weights seeded random values (without Transformers' own
    initialisation, which some architectures take many seconds over at real widths)."""
    torch.manual_seed(0)
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.02)
    return model


def _assert_bounds_cover_own_state(model: torch.nn.Module, tokens: int, name: str) -> None:
    """As ``_assert_bounds_cover_prefill_and_step``, in fp32 and bf16, for a model keeping its state in an
    output and argument of its own, ``name`` (RWKV's ``state``, xLSTM's ``cache``): a batch of two prompts
    of ``tokens``, then a step given the state the prompt left."""
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        ids = torch.randint(0, 1000, (2, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            prefill = _eager_peak(model, ids, use_cache=True)
            state = getattr(model(ids, use_cache=True), name)
            step = {"input_ids": ids[:, -1:], name: state, "use_cache": True}
            decode = _eager_peak(model, **step)
        first, bound = eager_call_bytes(model, (ids,), {"use_cache": True}), eager_call_bytes(model, (), step)
        assert first is not None and first >= prefill
        assert bound is not None and bound >= decode


def test_the_bound_covers_rg_lru_at_recurrentgemmas_width():
    """Measured from the allocator at RecurrentGemma 2B's width (2,560, one key head of 256): a prompt of
    512 positions, scanned one at a time, then a step. Its RG-LRU layer comes first and keeps its states in
    its module, so the cache's first layer holds no positions: the step's bound reads the longest layer's."""
    config = transformers.RecurrentGemmaConfig(
        num_hidden_layers=2, vocab_size=1000, hidden_size=2560, lru_width=2560, intermediate_size=3840,
        num_attention_heads=10, num_key_value_heads=1, attention_window_size=2048,
        block_types=["recurrent", "attention"],
    )  # fmt: skip
    _assert_bounds_cover_prefill_and_step(_randomly_filled(config), 1, 512)


def _empty_cache(model: torch.nn.Module) -> transformers.Cache:
    """The cache a generate of ``model`` starts with: Transformers' dynamic cache, or MiniMax's own."""
    if isinstance(model, transformers.MiniMaxForCausalLM):
        from transformers.models.minimax.modeling_minimax import MiniMaxCache

        return MiniMaxCache()
    return transformers.DynamicCache(config=model.config)


def _assert_bounds_cover_prefill_and_step(model: torch.nn.Module, batch: int, tokens: int) -> None:
    """The bound of a prefill of ``batch`` x ``tokens`` positions, and of the decode step after it (given
    the cache it filled), are at least what the allocator's peak shows each hold."""
    ids = torch.randint(0, 1000, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    cache = _empty_cache(model)
    step = {"input_ids": ids[:, -1:], "cache": cache}
    with torch.no_grad():
        prefill = _eager_peak(model, ids, cache=cache)
        bound = eager_call_bytes(model, (), step)
        decode = _eager_peak(model, **step)
    first = eager_call_bytes(model, (ids,), {})
    assert first is not None and first >= prefill
    assert bound is not None and bound >= decode


def _linear_attention(arch: str, checkpoint_config) -> torch.nn.Module:
    """A tiny model of ``arch``, seeded: Gated DeltaNet layers (two key heads of 32, four value heads of
    32), Mamba layers (an inner width of 256, states of 16), Mamba-2 layers (eight heads of 32, chunks of
    16), beside attention, routed experts or both; or ``checkpoint_config``'s."""
    mamba2 = {"hidden_size": 128, "vocab_size": 1000, "n_groups": 1, "chunk_size": 16}
    gated_delta_net = {
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4, "layer_types": ["linear_attention", "full_attention"],
    }  # fmt: skip
    if arch == "qwen3_next":  # routed experts too
        config = transformers.Qwen3NextConfig(
            **gated_delta_net, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64
        )
    elif arch == "olmo_hybrid":
        config = transformers.OlmoHybridConfig(**gated_delta_net, pad_token_id=0)
    elif arch in ("mamba", "falcon_mamba"):
        mamba = transformers.MambaConfig if arch == "mamba" else transformers.FalconMambaConfig
        config = mamba(
            hidden_size=128, intermediate_size=256, state_size=16, num_hidden_layers=2, vocab_size=1000
        )
    elif arch == "jamba":  # Mamba layers beside attention, routed experts
        config = transformers.JambaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, mamba_d_state=16, num_experts=4, num_experts_per_tok=2,
            attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, pad_token_id=0,
        )  # fmt: skip
    elif arch == "mamba2":
        config = transformers.Mamba2Config(
            **mamba2, num_hidden_layers=2, num_heads=8, head_dim=32, expand=2, state_size=16
        )
    elif arch == "nemotron_h":  # Mamba-2, attention and MLP layers
        config = transformers.NemotronHConfig(
            **mamba2, num_hidden_layers=3, hybrid_override_pattern="M*-", mamba_num_heads=8, mamba_head_dim=32,
            ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
        )  # fmt: skip
    elif arch == "falcon_h1":  # Mamba-2 and attention side by side in every layer
        config = transformers.FalconH1Config(
            hidden_size=128, vocab_size=1000, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, intermediate_size=256, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
            mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16, pad_token_id=0,
        )  # fmt: skip
    else:  # zamba, zamba2, granitemoehybrid, lfm2, lfm3, kimi_linear, bailing_hybrid, minimax, RG-LRU, zaya, inkling (2)
        config = checkpoint_config(arch)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# Gated DeltaNet, Mamba, Mamba-2, Kimi's delta attention and short convolutions, alone or beside
# attention (and experts)
LINEAR_ATTENTION = [
    "qwen3_next", "olmo_hybrid", "mamba", "falcon_mamba", "jamba", "mamba2", "nemotron_h", "falcon_h1", "zamba2",
    "zamba", "granitemoehybrid", "lfm2", "lfm3", "kimi_linear", "bailing_hybrid", "minimax", "recurrent_gemma",
    "zaya", "inkling", "inkling2",
]  # fmt: skip


@pytest.mark.parametrize("arch", LINEAR_ATTENTION)
def test_the_bound_covers_what_linear_attention_layers_hold_eagerly(arch, checkpoint_config):
    """Measured from the allocator: prompts shorter and longer than a chunk (Gated DeltaNet's 64
    positions, Mamba-2's 16 here: padded to whole chunks), a batch, and a decode step with the layers'
    states in its cache."""
    model = _linear_attention(arch, checkpoint_config)
    for batch, tokens in [(1, 3), (2, 65)]:
        _assert_bounds_cover_prefill_and_step(model, batch, tokens)
