"""Gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo hybrid and their kin), from the config alone: the
states their cache keeps, and what one such layer holds while it computes eagerly.

Transformers caches a linear-attention layer as a ``LinearAttentionLayer``: its convolution's last
``linear_conv_kernel_dim`` inputs (every query, key and value channel, in the model's dtype) and one
recurrent state per value head (``linear_key_head_dim`` x ``linear_value_head_dim``, in fp32, as the
kernels compute it), both written in place, whatever the length. Without the ``fla`` kernels (the CPU),
a prompt runs ``torch_chunk_gated_delta_rule``: queries, keys and values in fp32, padded to a multiple of
its chunk of 64 positions, with a chunk's pairwise decays and attention per position and head; a decode
step runs ``torch_recurrent_gated_delta_rule``, a few copies of every head's state. The bound here
counts both generously, for the layer that holds the most (layers compute one after another).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

# the config attributes of a Gated DeltaNet layer, all Transformers' families name them so
_SHAPE = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk of positions
_FP32 = 4
_KIND = "linear_attention"  # Transformers' layer type of such a layer
# per model: whether it has Transformers' Gated DeltaNet modules (``*GatedDeltaNet``)
_has_layers: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _shape(config: Any) -> tuple[int, int, int, int, int] | None:
    """Key heads, value heads, key and value head sizes and the convolution's kernel; None unless the
    config states them all."""
    values = [getattr(config, name, None) for name in (*_SHAPE, "linear_conv_kernel_dim")]
    numbers = [v for v in values if isinstance(v, int) and v > 0]
    if len(numbers) != len(values):
        return None
    k_heads, v_heads, k_dim, v_dim, kernel = numbers
    return k_heads, v_heads, k_dim, v_dim, kernel


def is_gated_delta_net(config: Any) -> bool:
    """Whether ``config`` (a decoder's text config, or one layer's) describes Gated DeltaNet layers."""
    return _shape(config) is not None


def state_bytes(config: Any, batch: int, itemsize: int) -> int | None:
    """Bytes one Gated DeltaNet layer's cache keeps for ``batch`` sequences (its convolution's inputs and
    its recurrent states), at any length; None where the config does not describe such layers."""
    shape = _shape(config)
    if shape is None:
        return None
    k_heads, v_heads, k_dim, v_dim, kernel = shape
    channels = 2 * k_heads * k_dim + v_heads * v_dim  # the convolution's: queries, keys and values
    return batch * (channels * kernel * itemsize + v_heads * k_dim * v_dim * _FP32)


def computing_bytes(
    model: nn.Module, config: Any, batch: int, tokens: int, itemsize: int, stepping: bool
) -> int | None:
    """What one Gated DeltaNet layer of ``model`` holds at most while it computes ``tokens`` positions of
    ``batch`` sequences eagerly, beside the model's dense per-token states (``stepping``: one position
    after cached ones, which the recurrent rule computes unpadded): 0 where no layer is one, None where
    layers are of that kind but not Transformers' ``*GatedDeltaNet`` modules the bound reads."""
    if model not in _has_layers:
        _has_layers[model] = any(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules())
    linear = _KIND in (getattr(config, "layer_types", None) or ())
    if not linear and not _has_layers[model]:
        return 0
    shape = _shape(config)
    if shape is None or not (linear and _has_layers[model]):
        return None
    k_heads, v_heads, k_dim, v_dim, _kernel = shape
    key_width, value_width = k_heads * k_dim, v_heads * v_dim
    # in the model's dtype, per position: the projections of queries, keys, values and gates, the
    # convolution's input, output and activation, queries and keys repeated to every value head, the
    # gated norm and its output; twice over
    projected = 2 * (2 * (2 * key_width + 2 * value_width) + 3 * (2 * key_width + value_width))
    projected += 2 * 2 * v_heads * k_dim + 4 * value_width
    # in fp32, per padded position and value head: a dozen copies of its query, key and value (cast,
    # normalised, scaled, padded, weighted by beta, decayed, solved for, the output), and the chunk's
    # pairwise decays, triangular system and attention (a row of the chunk each, a few of them)
    padded = tokens if stepping else -(-tokens // _CHUNK) * _CHUNK
    per_head = 16 * (k_dim + v_dim) + (0 if stepping else 10 * _CHUNK)
    # the recurrent state, and the copies an update makes (decayed, its products with the key and query)
    states = 5 * v_heads * k_dim * v_dim
    return batch * (tokens * projected * itemsize + (padded * v_heads * per_head + states) * _FP32)
