"""The bytes of ``generate``'s key/value cache, from a model's config alone (pure arithmetic, no weights).

Transformers builds a ``DynamicCache`` of one layer cache per decoder layer, of the kind its config names
(``cache_utils.get_layer_types_and_kwargs``): a full-attention layer keeps the keys and values of every
position, a sliding-window layer those of the last ``sliding_window - 1`` positions. ``cache_positions``
reads the same layer types through that function, so the prediction follows Transformers' own reading of
the config; any other kind of layer (state-space states, chunked or compressed attention, layers that
share another's cache) is not predicted.
"""

from __future__ import annotations

from typing import Any

# configs whose cache holds something other than keys and values of ``head_dim`` per head: compressed
# latents (multi-head latent attention), state-space states beside the attention layers
_OTHER_CACHES = ("kv_lora_rank", "state_size", "ssm_state_size")


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


def _per_position_bytes(text: Any, itemsize: int) -> int | None:
    """Bytes of one position's keys and values in one layer, for one sequence; None if not stated."""
    heads = _attr(text, "num_attention_heads")
    hidden = _attr(text, "hidden_size")
    if not (isinstance(heads, int) and heads > 0):
        return None
    kv_heads = _attr(text, "num_key_value_heads") or heads
    head_dim = _attr(text, "head_dim") or (hidden // heads if isinstance(hidden, int) else 0)
    return 2 * kv_heads * head_dim * itemsize if head_dim else None


def cache_positions(config: Any, length: int) -> list[int] | None:
    """Positions each layer's cache holds once ``length`` tokens went through; None where a layer holds
    anything else, or the layers cannot be told."""
    text = text_config(config)
    if any(_attr(text, attr) not in (None, 0) for attr in _OTHER_CACHES):
        return None
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        kinds, kwargs = get_layer_types_and_kwargs(text)
    except Exception:  # noqa: BLE001 - another Transformers, or a config it cannot read this way
        return None
    positions = []
    for kind, layer_kwargs in zip(kinds, kwargs, strict=True):
        if kind == "full_attention":
            positions.append(length)
        elif kind == "sliding_attention" and isinstance(layer_kwargs.get("sliding_window"), int):
            positions.append(min(length, layer_kwargs["sliding_window"] - 1))
        else:
            return None
    return positions if len(positions) == _attr(text, "num_hidden_layers") else None


def _per_layer_position_bytes(text: Any, itemsize: int) -> list[int] | None:
    """Each layer's bytes per position and sequence, from its own config where layers differ (Transformers'
    ``per_layer_config``: another head size for global layers, say); None where one is not stated."""
    layers = _attr(text, "num_hidden_layers")
    if not isinstance(layers, int):
        return None
    try:
        configs = list(text.per_layer_config)
    except Exception:  # noqa: BLE001 - an older Transformers, or a config without per-layer views
        configs = [text] * layers
    sizes = [_per_position_bytes(c, itemsize) for c in configs]
    if len(sizes) != layers or any(size is None for size in sizes):
        return None
    return sizes  # type: ignore[return-value]


def predicted_cache_bytes(config: Any, batch: int, length: int, itemsize: int) -> int | None:
    """Bytes of the cache of ``batch`` sequences after ``length`` tokens; None where not predicted."""
    positions = cache_positions(config, length)
    per_position = _per_layer_position_bytes(text_config(config), itemsize)
    if positions is None or per_position is None:
        return None
    return batch * sum(p * b for p, b in zip(positions, per_position, strict=True))


def kv_cache_bytes(config: Any, batch: int, seq_len: int, itemsize: int) -> int:
    """Bytes of ``generate``'s key/value cache at ``seq_len`` positions, for a plan: as predicted, else
    every layer's keys and values at full attention (an upper bound where layers hold less); 0 if the
    config does not say."""
    predicted = predicted_cache_bytes(config, batch, seq_len, itemsize)
    if predicted is not None:
        return predicted
    per_position = _per_layer_position_bytes(text_config(config), itemsize)
    return 0 if per_position is None else batch * seq_len * sum(per_position)
