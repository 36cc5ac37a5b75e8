"""The bytes of ``generate``'s key/value cache, from a model's config alone (pure arithmetic, no weights).

Transformers builds a ``DynamicCache`` of one layer cache per decoder layer, of the kind its config names
(``cache_utils.get_layer_types_and_kwargs``): a full-attention layer keeps the keys and values of every
position, a sliding-window layer those of the last ``sliding_window - 1`` positions. ``cache_positions``
reads the same layer types through that function, so the prediction follows Transformers' own reading of
the config: chunked attention is cached as a sliding window of the chunk's size, and a layer that reads
another layer's cache (Gemma 4's shared layers) or has no attention caches nothing. Multi-head latent
attention (DeepSeek's, a ``kv_lora_rank`` in the config) caches its compressed latents, one head of
``kv_lora_rank`` and one of ``qk_rope_head_dim`` per position (since Transformers 5.25, checked; earlier
versions are not predicted), and an indexed layer (DeepSeek V3.2's sparse attention) its indexer's keys
beside them. Linear-attention layers of the families ``linear_attention`` reads keep states of a fixed
size (a hybrid layer beside keys and values of every position). Any other kind of layer (other linear
attention, compressed attention) is not predicted.
"""

from __future__ import annotations

import re
from importlib.metadata import version
from typing import Any

from fxoffload_hf import linear_attention

# configs whose cache holds something other than keys and values per head or latents: state-space
# states beside the attention layers
_OTHER_CACHES = ("state_size", "ssm_state_size")
# the layer kinds whose cache holds every position (an indexed one: its indexer's keys too), and those
# that keep the last window of positions (Transformers caches chunked attention as a sliding window)
_FULL = ("full_attention", "indexed_attention")
_WINDOWED = ("sliding_attention", "chunked_attention")
# the layer kinds that hold no keys and values per position: a layer reading another's cache or without
# attention; and, where ``linear_attention`` sizes their states, linear layers other than hybrids
_POSITIONLESS = frozenset({"dummy"})
_LINEAR_POSITIONLESS = linear_attention.KINDS - {"hybrid", "hybrid_sliding"}
# the Transformers from which latent attention caches its latents (checked on 5.25.0)
_LATENTS_CACHED = tuple(map(int, re.findall(r"\d+", version("transformers"))[:2])) >= (5, 25)


def _attr(config: Any, name: str) -> Any:
    """``config.name``, or None where it is missing or not one value for the whole model (Transformers
    raises its own error for an attribute that varies by layer)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return None


def text_config(config: Any) -> Any:
    """The config of the text decoder (a multimodal model's language model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _per_position_bytes(text: Any, itemsize: int, kind: str = "full_attention") -> int | None:
    """Bytes of one position's keys and values in one layer of ``kind``, for one sequence; None if not
    stated."""
    latent = _attr(text, "kv_lora_rank")
    if latent:
        rope = _attr(text, "qk_rope_head_dim")
        if not (_LATENTS_CACHED and isinstance(latent, int) and isinstance(rope, int)):
            return None
        indexer = _attr(text, "index_head_dim") if kind == "indexed_attention" else 0
        return (latent + rope + (indexer if isinstance(indexer, int) else 0)) * itemsize
    if kind == "indexed_attention":
        return None
    sliding = (_attr(text, "swa_num_key_value_heads"), _attr(text, "swa_head_dim"))
    if kind == "hybrid_sliding" and all(isinstance(v, int) and v > 0 for v in sliding):
        return 2 * sliding[0] * sliding[1] * itemsize  # Inkling's sliding layers: heads of their own
    heads = _attr(text, "num_attention_heads")
    hidden = _attr(text, "hidden_size")
    if not (isinstance(heads, int) and heads > 0):
        return None
    kv_heads = _attr(text, "num_key_value_heads") or heads
    head_dim = _attr(text, "head_dim") or (hidden // heads if isinstance(hidden, int) else 0)
    return 2 * kv_heads * head_dim * itemsize if head_dim else None


def cache_positions(config: Any, length: int) -> list[int] | None:
    """Positions each layer's cache holds once ``length`` tokens went through, where every layer keeps
    keys and values per head (the layers whose caches ``reserved_cache`` and ``kv_disk`` hold); None
    where a layer holds anything else, or the layers cannot be told."""
    text = text_config(config)
    if any(_layer_is_latent(c) for c in (text, *_layer_configs(text))):
        return None
    return _positions(text, length, ("full_attention",), _layer_kinds(text))


def _positions(
    text: Any,
    length: int,
    full: tuple[str, ...],
    kinds: list[tuple[str, dict[str, Any]]] | None,
    linear: bool = False,
) -> list[int] | None:
    """``cache_positions`` with the layer kinds in ``full`` holding every position, the layers being of
    ``kinds`` (``_layer_kinds``); ``linear``: linear-attention layers hold no position (their states are
    counted apart: ``linear_attention``)."""
    if kinds is None or (not linear and any(_attr(text, attr) not in (None, 0) for attr in _OTHER_CACHES)):
        return None
    positions = []
    for kind, layer_kwargs in kinds:
        if kind in full or (linear and kind == "hybrid"):  # a hybrid: full attention beside its states
            positions.append(length)
        elif (kind in _WINDOWED or (linear and kind == "hybrid_sliding")) and isinstance(
            layer_kwargs.get("sliding_window"), int
        ):
            positions.append(min(length, layer_kwargs["sliding_window"] - 1))
        elif kind in _POSITIONLESS or (linear and kind in _LINEAR_POSITIONLESS):
            positions.append(0)
        else:
            return None
    return positions if len(positions) == _attr(text, "num_hidden_layers") else None


def _layer_kinds(text: Any) -> list[tuple[str, dict[str, Any]]] | None:
    """Each layer's cache kind and its arguments, as Transformers reads them; None where it cannot."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        kinds, kwargs = get_layer_types_and_kwargs(text)
    except Exception:  # noqa: BLE001 - another Transformers, or a config it cannot read this way
        return None
    return list(zip(kinds, kwargs, strict=True))


def _layer_configs(text: Any) -> list[Any]:
    """Each layer's config (Transformers' ``per_layer_config`` where layers differ), else the config for
    every layer."""
    layers = _attr(text, "num_hidden_layers")
    try:
        return list(text.per_layer_config)
    except Exception:  # noqa: BLE001 - an older Transformers, or a config without per-layer views
        return [text] * (layers if isinstance(layers, int) else 0)


def _layer_is_latent(config: Any) -> bool:
    """Whether ``config`` (a model's, or one layer's) has latent attention."""
    return _attr(config, "kv_lora_rank") not in (None, 0)


def _per_layer_position_bytes(
    text: Any, itemsize: int, kinds: list[tuple[str, dict[str, Any]]] | None, linear: bool = False
) -> list[int] | None:
    """Each layer's bytes per position and sequence, from its own config where layers differ (Transformers'
    ``per_layer_config``: another head size for global layers, say), the layers being of ``kinds``
    (``_layer_kinds``; None: read as full attention; ``linear``: as in ``_positions``); None where one is
    not stated."""
    configs = _layer_configs(text)
    if not configs or len(configs) != _attr(text, "num_hidden_layers"):
        return None
    names = [kind for kind, _ in kinds] if kinds is not None else ["full_attention"] * len(configs)
    if len(names) != len(configs):
        return None
    positionless = _POSITIONLESS | (_LINEAR_POSITIONLESS if linear else frozenset())
    sizes = [
        0 if kind in positionless else _per_position_bytes(c, itemsize, kind)
        for c, kind in zip(configs, names, strict=True)
    ]
    if any(size is None for size in sizes):
        return None
    return sizes  # type: ignore[return-value]


def predicted_cache_bytes(config: Any, batch: int, length: int, itemsize: int) -> int | None:
    """Bytes of the cache of ``batch`` sequences after ``length`` tokens (latent attention's latents,
    indexed layers' indexer keys and linear-attention layers' states too); None where not predicted."""
    layers = predicted_layer_bytes(config, batch, length, itemsize)
    return None if layers is None else sum(layers)


def predicted_layer_bytes(config: Any, batch: int, length: int, itemsize: int) -> list[int] | None:
    """``predicted_cache_bytes`` layer by layer (a model keeping its own state: that state in equal
    shares); None where not predicted."""
    text = text_config(config)
    own = linear_attention.own_state_bytes(text, batch, itemsize)
    if own is not None:  # RWKV's, xLSTM's: outside Transformers' caches
        layers = _attr(text, "num_hidden_layers") or 1
        share, rest = divmod(own, layers)
        return [share] * (layers - 1) + [share + rest]
    kinds = _layer_kinds(text)  # read once: Transformers builds every layer's kind from the config
    linear = linear_attention.is_read(text)
    positions = _positions(text, length, _FULL, kinds, linear)
    per_position = _per_layer_position_bytes(text, itemsize, kinds, linear)
    if positions is None or per_position is None:
        return None
    state = (linear_attention.state_bytes(text, batch, itemsize) or 0) if linear else 0
    is_linear = [linear and kind in linear_attention.KINDS for kind, _ in kinds or ()]
    return [
        batch * p * b + (state if has_state else 0)
        for p, b, has_state in zip(positions, per_position, is_linear, strict=True)
    ]


# Latent attention's keys are wider than its values, so scaled-dot-product attention takes its math kernel,
# which computes bf16 and fp16 in fp32 (measured on the CPU: DeepSeek-V3's decode step held 1.9x the bound
# without them): copies of the keys in fp32, two (the copy and the scaled copy), and of the values, one.
_FP32_KEY_COPIES = 2
_FP32_VALUE_COPIES = 1


def latent_expansion_bytes(config: Any, batch: int, length: int, itemsize: int) -> int:
    """What a decode step of latent attention holds beside the cache at ``length`` positions: one
    layer's latents expanded to every head's keys and values (and the projection they come from), for
    the layer that expands most; 0 without latent layers. In reduced precision, also the fp32 copies
    that attention's math kernel makes of them (``_FP32_KEY_COPIES``, ``_FP32_VALUE_COPIES``)."""
    most = 0
    for layer in _layer_configs(text_config(config)):
        if not _layer_is_latent(layer):
            continue
        heads = _attr(layer, "num_attention_heads") or 0
        nope, rope, value = (
            _attr(layer, n) or 0 for n in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        )
        expanded = heads * (2 * nope + rope + 2 * value) * itemsize
        if itemsize < 4:
            expanded += heads * (_FP32_KEY_COPIES * (nope + rope) + _FP32_VALUE_COPIES * value) * 4
        most = max(most, expanded)
    return batch * length * most


def kv_cache_bytes(config: Any, batch: int, seq_len: int, itemsize: int) -> int:
    """Bytes of ``generate``'s key/value cache at ``seq_len`` positions, for a plan: as predicted, else
    every layer's keys and values at full attention (an upper bound where layers hold less); 0 if the
    config does not say."""
    predicted = predicted_cache_bytes(config, batch, seq_len, itemsize)
    if predicted is not None:
        return predicted
    text = text_config(config)
    per_position = _per_layer_position_bytes(text, itemsize, _layer_kinds(text))
    return 0 if per_position is None else batch * seq_len * sum(per_position)
