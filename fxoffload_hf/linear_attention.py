"""Layers Transformers caches as linear attention, from the config alone: Gated DeltaNet's (Qwen3-Next,
Qwen3.5, OLMo hybrid, LaraMini), Mamba's (Mamba, Falcon-Mamba, Jamba), Mamba-2's (Mamba-2, Nemotron-H,
Bamba, Falcon-H1, Zamba 2, Granite 4), Kimi's delta attention (Kimi Linear, Bailing hybrid) and LFM2's
short convolutions: the states their cache keeps, and what one such layer holds while it computes
eagerly.

Transformers caches such a layer as a ``LinearAttentionLayer``: its convolution's last inputs (in the
model's dtype) and its recurrent states (in fp32, as the kernels compute them), both written in place,
whatever the length. Without the ``fla`` or ``mamba_ssm`` kernels (the CPU) its torch code runs:

- Gated DeltaNet: a prompt in ``torch_chunk_gated_delta_rule`` (queries, keys and values in fp32, padded
  to a multiple of its chunk of 64 positions, with a chunk's pairwise decays and attention per position
  and head), a decode step in ``torch_recurrent_gated_delta_rule`` (a few copies of every head's state);
- Mamba: a prompt in ``mamba_selective_scan``'s loop (the discretised state matrices of every position,
  ``intermediate_size`` x ``state_size`` each in fp32, before the scan runs through them), a decode step in
  ``mamba_selective_state_update`` (a few copies of the state);
- Kimi's delta attention: a prompt in ``chunk_kimi_delta_attention``, whose chunks decay every key
  channel apart (a chunk x head size matrix per position and head), a decode step in
  ``recurrent_kimi_delta_attention``;
- Mamba-2: a prompt in ``mamba2_chunk_scan`` (padded to whole chunks of ``chunk_size``, in fp32, with each
  chunk's segment sums and products per position and head, and every head's state per chunk), a decode
  step in ``mamba2_selective_state_update``.

The bound here counts them generously, for the layer that holds the most (layers compute one after
another). Other linear attention (Lightning attention, RG-LRU, RWKV, xLSTM, Zamba's multi-head Mamba) is
not read.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

_FP32 = 4
# Transformers' layer types of such layers: alone, or beside attention in the same layer (Falcon-H1's)
_KINDS = frozenset({"linear_attention", "hybrid", "conv"})
_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk of positions
# the config attributes of each family's layers, as all Transformers' models of it name them
_GATED_DELTA_NET = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip
_MAMBA = ("intermediate_size", "state_size", "conv_kernel", "time_step_rank")
_SHORT_CONV = ("hidden_size", "conv_L_cache")  # LFM2's gated short convolutions, over the hidden states
_KDA = ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")  # Kimi's delta attention
_JAMBA = ("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank")  # inner width: expand x hidden
# Mamba-2's sizes, as its families name them: heads, head size, state size, groups, kernel, chunk
_MAMBA2 = (
    ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"),  # Mamba-2
    ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"),  # Nemotron-H
    ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_chunk_size"),  # Bamba
    ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", "chunk_size"),  # Zamba 2
)  # fmt: skip
# the modules whose torch code the bound reads, by family
_MAMBA_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
_MAMBA2_MIXERS = frozenset(
    {
        "Mamba2Mixer",
        "NemotronHMamba2Mixer",
        "BambaMixer",
        "FalconH1Mixer",
        "GraniteMoeHybridMambaLayer",
        "Zamba2MambaMixer",
    }
)
# per model: the class names of its modules
_module_names: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def _value(config: Any, name: str) -> Any:
    """``config.name``, or None where it is missing or differs by layer (Transformers' own error)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return None


def _sizes(config: Any, names: tuple[str, ...]) -> list[int] | None:
    values = [_value(config, name) for name in names]
    numbers = [v for v in values if isinstance(v, int) and v > 0]
    return numbers if len(numbers) == len(values) else None


def _stated(config: Any, names: tuple[str, ...]) -> list[int]:
    """The sizes of a family ``_family`` found."""
    sizes = _sizes(config, names)
    assert sizes is not None
    return sizes


def _family(config: Any) -> str | None:
    """``"gated_delta_net"``, ``"mamba2"``, ``"mamba"`` or ``"short_conv"`` where ``config`` (a decoder's
    text config) describes such layers, else None."""
    if _sizes(config, _GATED_DELTA_NET) is not None:
        return "gated_delta_net"
    if _sizes(config, _SHORT_CONV) is not None:
        return "short_conv"
    if _sizes(config, _KDA) is not None:
        return "kda"
    if _mamba2_sizes(config) is not None:
        return "mamba2"
    if _mamba_sizes(config) is not None:
        return "mamba"
    return None


def _mamba2_sizes(config: Any) -> tuple[int, int, int, int, int, int] | None:
    """A Mamba-2 layer's heads, head size, state size, groups, convolution kernel and chunk (``_MAMBA2``'s
    names); None where not stated."""
    for names in _MAMBA2:
        sizes = _sizes(config, names)
        if sizes is not None:
            heads, head_dim, state, groups, kernel, chunk = sizes
            return heads, head_dim, state, groups, kernel, chunk
    return None


def _mamba_sizes(config: Any) -> tuple[int, int, int, int] | None:
    """A Mamba layer's inner width, state size, convolution kernel and time-step rank (Mamba's and
    Falcon-Mamba's names, or Jamba's); None where not stated, or for Mamba-2 (its groups of heads)."""
    if any(_value(config, name) is not None for name in ("n_groups", "n_mamba_heads")):
        return None  # Mamba-2's groups, Zamba's heads
    mamba = _sizes(config, _MAMBA)
    if mamba is not None:
        inner, state, kernel, rank = mamba
        return inner, state, kernel, rank
    jamba = _sizes(config, (*_JAMBA, "hidden_size"))
    if jamba is not None:
        expand, state, kernel, rank, hidden = jamba
        return expand * hidden, state, kernel, rank
    return None


def is_read(config: Any) -> bool:
    """Whether ``config``'s linear-attention layers are of a family this module sizes."""
    return _family(config) is not None


def state_bytes(config: Any, batch: int, itemsize: int) -> int | None:
    """Bytes one linear-attention layer's cache keeps for ``batch`` sequences (its convolution's inputs and
    its recurrent states), at any length; None where the config describes no family read here."""
    family = _family(config)
    if family == "gated_delta_net":
        k_heads, v_heads, k_dim, v_dim, kernel = _stated(config, _GATED_DELTA_NET)
        channels = 2 * k_heads * k_dim + v_heads * v_dim  # the convolution's: queries, keys and values
        return batch * (channels * kernel * itemsize + v_heads * k_dim * v_dim * _FP32)
    if family == "mamba":
        inner, state, kernel, _rank = _mamba_sizes(config) or (0, 0, 0, 0)
        return batch * inner * (kernel * itemsize + state * _FP32)
    if family == "kda":
        heads, head_dim, kernel = _stated(config, _KDA)
        channels = 3 * heads * head_dim  # the convolutions': queries, keys and values
        return batch * (channels * kernel * itemsize + heads * head_dim * head_dim * _FP32)
    if family == "short_conv":
        hidden, kernel = _stated(config, _SHORT_CONV)
        return batch * hidden * kernel * itemsize  # the convolution's last inputs, no recurrent state
    if family == "mamba2":
        heads, head_dim, state, groups, kernel, _chunk = _mamba2_sizes(config) or (0, 0, 0, 0, 0, 0)
        channels = heads * head_dim + 2 * groups * state  # the convolution's: the inner states, B and C
        return batch * (channels * kernel * itemsize + heads * head_dim * state * _FP32)
    return None


def computing_bytes(
    model: nn.Module, config: Any, batch: int, tokens: int, itemsize: int, stepping: bool
) -> int | None:
    """What one linear-attention layer of ``model`` holds at most while it computes ``tokens`` positions
    of ``batch`` sequences eagerly, beside the model's dense per-token states (``stepping``: one position
    after cached ones, which the recurrent rule computes): 0 where the model has no such layer, None where
    its layers are not of a family and modules read here."""
    if model not in _module_names:
        _module_names[model] = frozenset(type(m).__name__ for m in model.modules())
    names = _module_names[model]
    gated = any(name.endswith("GatedDeltaNet") for name in names)
    short_conv = any(name.endswith("ShortConv") for name in names)
    kda = any(name.endswith("DeltaAttention") for name in names)
    mamba, mamba2 = bool(names & _MAMBA_MIXERS), bool(names & _MAMBA2_MIXERS)
    linear = bool(_KINDS & set(_value(config, "layer_types") or ()))
    if not (linear or gated or short_conv or kda or mamba or mamba2):
        return 0
    family = _family(config)
    if [gated, short_conv, kda, mamba, mamba2].count(True) != 1:
        return None  # no module, or several families, the bound reads
    if family == "kda" and kda:
        return _kda_bytes(config, batch, tokens, itemsize, stepping)
    if family == "short_conv" and short_conv:
        # per position, in the model's dtype: the input projection (three widths), the gated input, the
        # convolution's output, the gated output, its copy and projection; twice over
        return batch * tokens * 2 * 8 * _stated(config, _SHORT_CONV)[0] * itemsize
    if family == "gated_delta_net" and gated and linear:
        return _gated_delta_net_bytes(config, batch, tokens, itemsize, stepping)
    if family == "mamba" and mamba:
        return _mamba_bytes(config, batch, tokens, itemsize, stepping)
    if family == "mamba2" and mamba2:
        return _mamba2_bytes(config, batch, tokens, itemsize, stepping)
    return None


def _gated_delta_net_bytes(config: Any, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    k_heads, v_heads, k_dim, v_dim, _kernel = _stated(config, _GATED_DELTA_NET)
    key_width, value_width = k_heads * k_dim, v_heads * v_dim
    # in the model's dtype, per position: the projections of queries, keys, values and gates, the
    # convolution's input, output and activation, queries and keys repeated to every value head, the
    # gated norm and its output; twice over
    projected = 2 * (2 * (2 * key_width + 2 * value_width) + 3 * (2 * key_width + value_width))
    projected += 2 * 2 * v_heads * k_dim + 4 * value_width
    # in fp32, per (padded) position and value head: a dozen copies of its query, key and value (cast,
    # normalised, scaled, padded, weighted by beta, decayed, solved for, the output), and a prompt's
    # chunk: pairwise decays, triangular system and attention (a row of the chunk each, a few of them)
    padded = tokens if stepping else -(-tokens // _CHUNK) * _CHUNK
    per_head = 16 * (k_dim + v_dim) + (0 if stepping else 10 * _CHUNK)
    # the recurrent state, and the copies an update makes (decayed, its products with the key and query)
    states = 5 * v_heads * k_dim * v_dim
    return batch * (tokens * projected * itemsize + (padded * v_heads * per_head + states) * _FP32)


def _mamba_bytes(config: Any, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    inner, state, _kernel, rank = _mamba_sizes(config) or (0, 0, 0, 0)
    # per position, in the model's dtype: the input projection (twice the inner width), the convolution's
    # input, output and activation, the time step and its projection, the scan's output and gate; twice
    projected = 2 * (10 * inner + 2 * (rank + 2 * state)) * itemsize
    # in fp32: a prompt's discretised A, B and B times the input for every position (and the product
    # before A's exponential), the time step and each position's output; a step's state, copied a few times
    scanned = (4 * inner * state + 4 * inner) * _FP32
    states = (6 if stepping else 3) * inner * state * _FP32
    return batch * (tokens * (projected + (0 if stepping else scanned)) + states)


def _mamba2_bytes(config: Any, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, state, groups, _kernel, chunk = _mamba2_sizes(config) or (0, 0, 0, 0, 0, 0)
    inner, channels = heads * head_dim, heads * head_dim + 2 * groups * state
    # per position, in the model's dtype: the input projection (gate, convolution's input, time steps),
    # the convolution's output and activation, the gated norm and its output; twice over
    projected = 2 * (2 * inner + 3 * channels + heads + 4 * inner) * itemsize
    states = 6 * heads * head_dim * state * _FP32  # the state, and the copies a step or a chunk makes
    if stepping:
        return batch * (tokens * projected + states)
    # a prompt's chunked scan, padded to whole chunks, in fp32: per position and head its inputs (cast,
    # scaled, padded, chunked, the skip connection), B and C repeated to every head and decayed, the
    # outputs within and across chunks; the chunk's segment sums, decays and products (a row of the
    # chunk each, a few of them); per chunk, every head's state a few times over
    padded = -(-tokens // chunk) * chunk
    scanned = padded * heads * (12 * head_dim + 8 * state + 8 * chunk) * _FP32
    per_chunk = 4 * (padded // chunk + 1) * heads * head_dim * state * _FP32
    return batch * (tokens * projected + scanned + per_chunk + states)


def _kda_bytes(config: Any, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, _kernel = _stated(config, _KDA)
    width = heads * head_dim
    # per position, in the model's dtype: the projections of queries, keys and values, their convolutions'
    # outputs and activations, the decay's and gate's projections, the gated norm; twice over
    projected = 2 * 16 * width * itemsize
    states = 5 * heads * head_dim * head_dim * _FP32  # the state, and the copies an update makes
    if stepping:
        return batch * (tokens * (projected + 16 * width * _FP32) + states)
    # a prompt's chunks, in fp32, per padded position and head: a dozen copies of its query, key, value and
    # decay, and the chunk's decays per key channel (chunk x head size: the decay mask, the products of
    # keys with it, the intra-chunk attention in the loop) besides its triangular system
    padded = -(-tokens // _CHUNK) * _CHUNK
    per_head = 16 * head_dim + 4 * _CHUNK * head_dim + 4 * _CHUNK
    return batch * (tokens * projected + (padded * heads * per_head) * _FP32 + states)
