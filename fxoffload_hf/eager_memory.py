"""What one eager call of a model holds beside its weights, bounded from its config and the call's shape:
the gate of ``capture="deferred"``, which runs a call eagerly only where this bound fits the budget beside
the largest module's weights, and captures it otherwise (a captured graph's activations are measured
exactly, ``activations``).

A transformer's eager call holds, per token (the encoder's and the decoder's), a few hidden states, its
queries, keys and values and its MLP's intermediate states; its attention scores (batch x heads x queries
x keys, in fp32, twice: the scores and their softmax) and masks where the kernel materialises them; the
KV cache the call ends with, and a copy of its largest layer (a dynamic layer grows by a concatenation,
both copies held for a moment, one layer at a time); the output head's logits at the kept positions (in fp32,
twice: Transformers upcasts them), and with labels the loss's log-probabilities of every position; every
layer's hidden states and attention probabilities, and a mixture of experts' router logits, where the call
(or the config) asks for them back; on
the CPU in bf16, a product's scratchpad (oneDNN's, per thread).
The bound counts all of it generously: it gates, it does not plan, and
a bound too high only costs a call the wait for capture. Only where every layer is an attention layer
whose cache ``kv_cache`` predicts (keys and values per head, or latent attention's latents, expanded to
every head's keys and values in each layer's call, and in reduced precision copied to fp32) or a
linear-attention layer of a family ``linear_attention`` reads (Gated DeltaNet, Mamba, Mamba-2, Kimi's
delta attention, short convolutions, Lightning attention): other scans and recurrences hold states no
config bound sees.

Routed experts add, per token and expert it is routed to, the token's states and its expert's
intermediate states, and the router's logits over all experts (every layer's, and their auxiliary
loss's work, where the call returns them); only where their eager code
computes on views of the stacked expert weights: Transformers' experts modules with the ``eager`` or
``grouped_mm`` implementation on the CPU (measured: ``batched_mm`` gathers a copy of an expert's weights
for every routed token), and Llama 4's own, which runs every token through every expert. A call it
cannot read (no config, inputs other than token ids or their embeddings, layers other than those, experts
outside those) has no bound, and is captured.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxoffload_hf import linear_attention
from fxoffload_hf.kv_cache import latent_expansion_bytes, predicted_layer_bytes, text_config
from fxoffload_hf.reserved_cache import disk_resident_bytes

# Per query and key where attention's scores are materialised (scaled-dot-product attention's math kernel,
# which latent attention takes; measured on the CPU at 1, 4 and 8 heads in fp32 and bf16: 9.35 bytes per
# head and 4 per sequence): per head, the fp32 scores, their softmax and a byte of its check for rows
# wholly masked (one more, rounding 9.35 up); per sequence, the fp32 mask it adds and the boolean ones it
# is made from.
_SCORE_BYTES = 4 + 4 + 1 + 1
_MASK_BYTES = 4 + 2
# arguments that do not change what a decoder's call holds (beside the token ids and the cache)
_SHAPE_FREE = {
    "attention_mask",
    "decoder_attention_mask",
    "position_ids",
    "cache_position",
    "token_type_ids",
    "use_cache",
    "return_dict",
}
# switches that keep every layer's states to return them (read as the call resolves them: the keyword,
# else the config's own setting)
_KEEPING = ("output_hidden_states", "output_attentions")
# a config's layer counts under the names configs give them (an encoder-decoder's, each side's)
_LAYER_COUNTS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)
# each side's tokens as ids (2-D) or as their embeddings (3-D), the encoder's first: an encoder-decoder's
# are both computed in one call
_SEQUENCES = (("input_ids", 2), ("inputs_embeds", 3), ("decoder_input_ids", 2), ("decoder_inputs_embeds", 3))
_DECODER_SEQUENCES = ("decoder_input_ids", "decoder_inputs_embeds")
# what a bf16 product on the CPU takes for itself, per thread (``_product_scratch``)
_BF16_SCRATCH_PER_THREAD = 256 * 1024
# Transformers 5.25's name for the cache argument, earlier ones', and RWKV's state (five tensors: read
# only for RWKV, ``linear_attention.own_state_bytes``)
_CACHES = ("cache", "past_key_values", "state")
# the MLP's intermediate width under the names configs give it; the counts of routed experts, the experts
# each token is routed to, and an expert's intermediate width
_INNER_WIDTHS = ("intermediate_size", "ffn_dim", "n_inner", "d_ff")
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "num_selected_experts", "moe_topk", "moe_k", "top_k")
_EXPERT_WIDTHS = ("moe_intermediate_size", "expert_intermediate_size", *_INNER_WIDTHS)
# Transformers' experts implementations whose code computes on views of the stacked weights on the CPU
_VIEWING_EXPERTS = frozenset({"eager", "grouped_mm"})
# experts modules of their own that run every token through every expert, with batched products on the
# stacked weights themselves (Llama 4's: the router scales each expert's copy of the token)
_EVERY_EXPERT = frozenset({"Llama4TextExperts"})
# the class names of modules that route tokens to experts, where experts are not one stacked weight
_ROUTING_NAMES = re.compile("moe|expert|router|sparse", re.IGNORECASE)


@dataclass(frozen=True)
class _Experts:
    """A model's experts modules: the configs of Transformers' ones, the devices of their stacked weights,
    whether one runs every token through every expert (``_EVERY_EXPERT``), and whether the model routes
    tokens at all (a config may describe experts its layers do not build: a Nemotron-H without ``E``
    layers keeps the defaults of its mixture-of-experts variant)."""

    configs: tuple[Any, ...]
    devices: frozenset[str]
    every_expert: bool
    routes: bool


# per model: its experts modules, or None where a stacked weight lies outside those the bound reads
_experts_of: weakref.WeakKeyDictionary[nn.Module, _Experts | None] = weakref.WeakKeyDictionary()


def eager_call_bytes(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device_type: str | None = None
) -> int | None:
    """A bound on what ``model(*args, **kwargs)`` holds beside its weights when run eagerly on
    ``device_type`` (where its parameters lie unless given: ``plan`` builds on the meta device); None
    where the call or the config cannot be read."""
    config = getattr(model, "config", None)
    inputs = _named_inputs(args, kwargs)
    if config is None or inputs is None:
        return None
    text = text_config(config)
    hidden, heads, vocab = (_int(text, name) for name in ("hidden_size", "num_attention_heads", "vocab_size"))
    lengths = _sequence_lengths(inputs, bool(getattr(config, "is_encoder_decoder", False)))
    cache = next((inputs[n] for n in _CACHES if inputs.get(n) is not None), None)
    # a state of the model's own (RWKV's, xLSTM's): how many positions went through it does not matter
    past = 1 if cache is not None and linear_attention.keeps_own_state(text) else _cached_positions(cache)
    if lengths is None or past is None or not (hidden and vocab):
        return None
    batch, tokens, decoded = lengths
    keys = past + tokens
    itemsize = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    # layers whose cache is not predicted (other scans and recurrences) hold what no config bound sees:
    # a tiny Falcon-H1's eager call held 465 MiB before its Mamba-2 layers had a term (measured)
    cache_layers = predicted_layer_bytes(config, batch, keys, itemsize)
    if cache_layers is None:
        return None
    routed = _routed_bytes(model, text, hidden, itemsize, device_type)
    stepping = past > 0 and tokens == 1  # one position after cached ones: a recurrent step
    linear = linear_attention.computing_bytes(model, text, batch, tokens, itemsize, stepping)
    # no heads and no linear layers: attention whose scores are not bounded (latents cache without heads)
    if routed is None or linear is None or not (heads or linear):
        return None
    per_token = (12 * hidden + 4 * _inner_width(text, hidden) + _latent_query_width(text)) * itemsize + routed
    # latent attention expands one layer's cached latents to every head's keys and values; an indexer
    # scores every key with heads of its own before it keeps a few
    expanded = latent_expansion_bytes(config, batch, keys, itemsize)
    score_heads = heads + _int(text, "index_n_heads")
    scores = batch * tokens * keys * (score_heads * _SCORE_BYTES + _MASK_BYTES)
    logits = 2 * batch * _kept_positions(inputs.get("logits_to_keep"), decoded) * vocab * 4
    on_disk = disk_resident_bytes(cache)  # a cache kept on disk has about two layers in memory
    # the cache the call ends with, and a copy of the layer it extends (a dynamic layer grows by a
    # concatenation: both copies are held for a moment, one layer at a time)
    cache_bytes = sum(cache_layers) + max(cache_layers, default=0) if on_disk is None else on_disk
    scratch = _product_scratch(model, device_type)
    # a loss over the labels: the log-probabilities of every position (fp32, beside the upcast logits)
    loss = batch * decoded * vocab * 4 if _holds_more(inputs.get("labels")) else 0
    layers = max(len(cache_layers), *(_int(c, name) for c in (config, text) for name in _LAYER_COUNTS))
    returned = _returned_states(config, text, inputs, layers, batch * tokens * hidden, scores, itemsize)
    router = _router_logits_bytes(config, text, inputs, layers, batch * tokens) if routed else 0
    extra = loss + returned + router
    return batch * tokens * per_token + expanded + scores + logits + cache_bytes + linear + scratch + extra


def _returned_states(
    config: Any, text: Any, inputs: dict[str, Any], layers: int, states: int, scores: int, itemsize: int
) -> int:
    """What a call that returns every layer's states keeps (``_KEEPING``): each of ``layers`` layers'
    hidden states (``states`` elements each, and the embeddings'), each layer's attention probabilities (at
    most ``scores`` bytes each, in the model's dtype: bounded by the fp32 scores')."""
    hidden = (layers + 1) * states * itemsize if _asked(config, text, inputs, "output_hidden_states") else 0
    attentions = layers * scores if _asked(config, text, inputs, "output_attentions") else 0
    return hidden + attentions


def _router_logits_bytes(config: Any, text: Any, inputs: dict[str, Any], layers: int, tokens: int) -> int:
    """What a mixture of experts' call that returns its router logits (``output_router_logits``) holds for
    them over ``tokens`` tokens: every layer's logits, and their auxiliary loss's work, generously (Switch's
    and NLLB-MoE's loss one-hot encode every layer's choices as int64; the others' go layer by layer: a
    softmax, the choices and the padding's weights)."""
    if not _asked(config, text, inputs, "output_router_logits"):
        return 0
    experts, routed = _expert_counts(text)
    chosen = routed or experts
    per_layer = experts * (4 + 8 + 4) + chosen * 16
    return tokens * (layers * per_layer + 3 * experts * 4)


def _asked(config: Any, text: Any, inputs: dict[str, Any], name: str) -> bool:
    """Whether the call asks for ``name`` back: its keyword, else ``config``'s or its text config's own
    setting (Transformers' resolution)."""
    value = inputs.get(name)
    if value is None:
        return bool(getattr(config, name, False) or getattr(text, name, False))
    return bool(value)


def _product_scratch(model: nn.Module, device_type: str | None) -> int:
    """What a product of bf16 weights on the CPU takes for itself while it computes: oneDNN's scratchpad,
    per thread, one product at a time (measured on an AMD EPYC with AVX-512 BF16 and no AMX: up to 193 KiB
    a thread, for shapes from 64 x 64 to 16,384 x 4,096 and 1 to 2,048 rows; none there in fp32 or fp16).
    Where any parameter is bf16: a model may keep its first ones in fp32."""
    bf16 = next((p for p in model.parameters() if p.dtype is torch.bfloat16), None)
    if bf16 is None or (device_type or bf16.device.type) != "cpu":
        return 0
    return _BF16_SCRATCH_PER_THREAD * torch.get_num_threads()


def _named_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The call's arguments by name (the one positional argument is the token ids); None where the call
    passes anything the bound does not count."""
    if len(args) > 1 or (args and "input_ids" in kwargs):
        return None
    inputs = {**kwargs, **({"input_ids": args[0]} if args else {})}
    counted = _SHAPE_FREE | {
        *(name for name, _ in _SEQUENCES),
        *_CACHES,
        *_KEEPING,
        "output_router_logits",
        "logits_to_keep",
        "encoder_outputs",
        "labels",
    }
    return None if any(_holds_more(v) for k, v in inputs.items() if k not in counted) else inputs


def _sequence_lengths(inputs: dict[str, Any], encoder_decoder: bool) -> tuple[int, int, int] | None:
    """Batch, tokens the call computes (the encoder's, held or computed, and the decoder's) and positions
    it returns logits for; None unless every sequence input is token ids (2-D) or their embeddings (3-D)
    of one batch. An encoder-decoder given labels and no decoder tokens decodes the labels shifted."""
    sequences = [
        (inputs[name], dims) for name, dims in _SEQUENCES if isinstance(inputs.get(name), torch.Tensor)
    ]
    if sum(inputs.get(name) is not None for name, _ in _SEQUENCES) > len(sequences):
        return None
    labels = inputs.get("labels")
    decoded = any(inputs.get(name) is not None for name in _DECODER_SEQUENCES)
    if encoder_decoder and not decoded and isinstance(labels, torch.Tensor):
        sequences.append((labels, 2))
    held = _first_tensor(inputs.get("encoder_outputs"))
    if not sequences or any(t.dim() != dims for t, dims in sequences):
        return None
    if held is not None and not (isinstance(held, torch.Tensor) and held.dim() == 3):
        return None
    sizes = {t.shape[0] for t, _ in sequences} | ({held.shape[0]} if held is not None else set())
    if len(sizes) != 1:
        return None
    encoder_tokens = 0 if held is None else held.shape[1]
    tokens = sum(t.shape[1] for t, _ in sequences) + encoder_tokens
    return sizes.pop(), tokens, sequences[-1][0].shape[1]


def _first_tensor(outputs: Any) -> Any:
    """An encoder's hidden states from its outputs (a ``ModelOutput``, a tuple or the tensor itself)."""
    if outputs is None or isinstance(outputs, torch.Tensor):
        return outputs
    return outputs.to_tuple()[0] if hasattr(outputs, "to_tuple") else outputs[0]


def _holds_more(value: Any) -> bool:
    """Whether an argument the bound does not name may make the call hold more (other inputs: embeddings,
    pixels, labels; switches that keep every layer's states): anything but None or False, or a container
    of nothing else (``generate`` passes a multimodal model's text-only calls ``mm_encoder_outputs={}``)."""
    if isinstance(value, dict):
        return any(_holds_more(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_more(v) for v in value)
    return value is not None and value is not False


def _int(config: Any, name: str) -> int:
    try:
        value = getattr(config, name, None)
    except Exception:  # noqa: BLE001 - an attribute that varies by layer (Transformers' own error)
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def _inner_width(text: Any, hidden: int) -> int:
    """The width of a token's MLP states."""
    return max((_int(text, name) for name in _INNER_WIDTHS), default=0) or 4 * hidden


def _latent_query_width(text: Any) -> int:
    """What latent attention's queries add per token beside the dense bound: every head's query, its
    positional part and its value, twice over (0 without latents)."""
    if not _int(text, "kv_lora_rank"):
        return 0
    per_head = sum(_int(text, name) for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    return 2 * _int(text, "num_attention_heads") * per_head + _int(text, "q_lora_rank")


def _routed_bytes(
    model: nn.Module, text: Any, hidden: int, itemsize: int, device_type: str | None
) -> int | None:
    """What routed experts add per token beside the dense bound (0 without them); None where their eager
    code may copy expert weights (``_experts_compute_on_views``)."""
    experts, routed = _expert_counts(text)
    if experts <= 1:
        return 0
    found = _experts_computing_on_views(model, device_type)
    if found is None:
        return None
    if not found.routes:
        return 0
    per_token = experts if found.every_expert or not routed else routed
    width = max(_int(text, name) for name in _EXPERT_WIDTHS) or 4 * hidden
    # each routed copy of the token: its states, its expert's gate, up and activation states, and the
    # expert's output, twice over; the router's logits and probabilities (fp32) and the routing indices
    states = 2 * per_token * (2 * hidden + 3 * width) * itemsize
    return states + 2 * experts * 4 + 4 * per_token * 8


def _expert_counts(text: Any) -> tuple[int, int]:
    """The config's count of routed experts and of experts each token is routed to (0 where unset)."""
    experts = max(_int(text, name) for name in _EXPERT_COUNTS)
    return experts, max((_int(text, name) for name in _EXPERTS_PER_TOKEN), default=0)


def _experts_computing_on_views(model: nn.Module, device_type: str | None) -> _Experts | None:
    """``model``'s experts modules where every stacked (3-D or more) weight belongs to one whose code
    computes on views of it, on the CPU: a Transformers experts module whose implementation does
    (``_VIEWING_EXPERTS``), or one of ``_EVERY_EXPERT``; else None."""
    if model not in _experts_of:
        _experts_of[model] = _experts_modules(model)
    found = _experts_of[model]
    if found is None:
        return None
    on = {device_type} if device_type is not None else found.devices
    viewing = all(
        getattr(config, "_experts_implementation", None) in _VIEWING_EXPERTS for config in found.configs
    )
    return found if on <= {"cpu"} and viewing else None


def _experts_modules(model: nn.Module) -> _Experts | None:
    """``model``'s experts modules: Transformers' (``use_experts_implementation``: they carry
    ``is_transposed``) and those of ``_EVERY_EXPERT``; None where a stacked weight lies outside them."""
    configs: list[Any] = []
    devices: set[str] = set()
    every_expert = routing_names = False
    for module in model.modules():
        routing_names = routing_names or bool(_ROUTING_NAMES.search(type(module).__name__))
        # a bank of several matrices (not a convolution's kernel, nor a gate's parameters kept 4-D to
        # broadcast: Kimi's forget gate's (1, 1, heads, 1))
        stacked = [p for p in module.parameters(recurse=False) if p.dim() > 2 and p.shape[0] > 1]
        if not stacked or isinstance(module, nn.modules.conv._ConvNd):
            continue
        config = getattr(module, "config", None)
        if type(module).__name__ in _EVERY_EXPERT:
            every_expert = True
        elif hasattr(module, "is_transposed") and config is not None:
            configs.append(config)
        else:
            return None
        devices.update(p.device.type for p in stacked)
    routes = bool(configs) or every_expert or routing_names
    return _Experts(tuple(configs), frozenset(devices), every_expert, routes)


def _cached_positions(cache: Any) -> int | None:
    """Positions already in the cache a call is passed (0 without one); None where it cannot be read."""
    if cache is None:
        return 0
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return None
    try:
        first = int(length())
    except Exception:  # noqa: BLE001 - a cache kind that cannot tell its length this way
        return None
    # the longest layer's: a hybrid's first layer may be one whose states its modules keep (RG-LRU's)
    layers = [layer for layer in getattr(cache, "layers", None) or () if hasattr(layer, "get_seq_length")]
    return max([first, *(int(layer.get_seq_length()) for layer in layers)])


def _kept_positions(logits_to_keep: Any, queries: int) -> int:
    """Positions whose logits the call returns (Transformers' ``logits_to_keep``: 0 means all)."""
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        return min(logits_to_keep, queries)
    if isinstance(logits_to_keep, torch.Tensor):
        return min(int(logits_to_keep.numel()), queries)
    return queries
