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


def text_config(config: Any) -> Any:
    """The config of the text decoder (a multimodal model's language model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _per_position_bytes(text: Any, itemsize: int) -> int | None:
    """Bytes of one position's keys and values in one layer, for one sequence; None if not stated."""
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    if not (isinstance(heads, int) and heads > 0):
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if isinstance(hidden, int) else 0)
    return 2 * kv_heads * head_dim * itemsize if head_dim else None


def cache_positions(config: Any, length: int) -> list[int] | None:
    """Positions each layer's cache holds once ``length`` tokens went through; None where a layer holds
    anything else, or the layers cannot be told."""
    text = text_config(config)
    if any(getattr(text, attr, None) not in (None, 0) for attr in _OTHER_CACHES):
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
    return positions if len(positions) == getattr(text, "num_hidden_layers", len(positions)) else None


def predicted_cache_bytes(config: Any, batch: int, length: int, itemsize: int) -> int | None:
    """Bytes of the cache of ``batch`` sequences after ``length`` tokens; None where not predicted."""
    positions = cache_positions(config, length)
    per_position = _per_position_bytes(text_config(config), itemsize)
    if positions is None or per_position is None:
        return None
    return batch * per_position * sum(positions)


def kv_cache_bytes(config: Any, batch: int, seq_len: int, itemsize: int) -> int:
    """Bytes of ``generate``'s key/value cache at ``seq_len`` positions, for a plan: as predicted, else
    every layer's keys and values at full attention (an upper bound where layers hold less); 0 if the
    config does not say."""
    predicted = predicted_cache_bytes(config, batch, seq_len, itemsize)
    if predicted is not None:
        return predicted
    text = text_config(config)
    layers = getattr(text, "num_hidden_layers", None)
    per_position = _per_position_bytes(text, itemsize)
    if not isinstance(layers, int) or per_position is None:
        return 0
    return layers * batch * per_position * seq_len
