"""Layers Transformers caches as linear attention, from the config alone: Gated DeltaNet's (Qwen3-Next,
Qwen3.5, OLMo hybrid, LaraMini), Mamba's (Mamba, Falcon-Mamba, Jamba, and Zamba's, in heads that scan one
after another), Mamba-2's (Mamba-2, Nemotron-H, Bamba, Falcon-H1, Zamba 2, Granite 4), Kimi's delta
attention (Kimi Linear, Bailing hybrid), LFM2's short convolutions and MiniMax's Lightning attention: the
states their cache keeps, and what one such layer holds while it computes eagerly.

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
  step in ``mamba2_selective_state_update``;
- Lightning attention (MiniMax's own cache keeps its state, in the model's dtype): a prompt in blocks of
  ``block_size`` positions (a block's pairwise weights per head, and their decayed copy), later positions
  one at a time.

The bound here counts them generously, for the layer that holds the most (layers compute one after
another). RecurrentGemma's RG-LRU keeps its states in its modules (not in the cache), in fp32 and the
model's dtype, and scans a prompt one position at a time. Zaya's compressed convolutional attention keeps a
convolution's last inputs and a delayed half of the values beside its keys and values. Other linear
attention (xLSTM, Inkling's short convolutions) is not read.

RWKV keeps its state outside Transformers' caches (``state``, five tensors of every layer, whatever the
length: the last inputs of its attention and feed-forward in the model's dtype, the attention's numerator,
denominator and running maximum in fp32), and computes a prompt one position at a time: a layer holds its
per-token states (which the dense bound counts) and a few copies of its state (``own_state_bytes``,
``computing_bytes``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

_FP32 = 4
# Transformers' layer types of such layers: alone, beside attention in the same layer (Falcon-H1's), or
# a short convolution
KINDS = frozenset({"linear_attention", "hybrid", "conv"})
_CHUNK = 64  # the delta rules' chunk of positions (Gated DeltaNet's, Kimi's)
# per model: the class names of its modules
_module_names: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()

Sizes = tuple[int, ...]


@dataclass(frozen=True)
class _Family:
    """One family of layers: its sizes from a config (None where the config does not state them), whether
    a module's class is one of its layers, its cache's bytes (sizes, batch, itemsize) and what one layer
    holds computing (sizes, batch, tokens, itemsize, stepping)."""

    sizes: Callable[[Any], Sizes | None]
    is_layer: Callable[[str], bool]
    state: Callable[[Sizes, int, int], int]
    computing: Callable[[Sizes, int, int, int, bool], int]


def _value(config: Any, name: str) -> Any:
    """``config.name``, or None where it is missing or differs by layer (Transformers' own error)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return None


def _named(*names: str) -> Callable[[Any], Sizes | None]:
    """Sizes read from the config attributes ``names`` (all positive integers, else None)."""

    def read(config: Any) -> Sizes | None:
        values = [_value(config, name) for name in names]
        numbers = tuple(v for v in values if isinstance(v, int) and v > 0)
        return numbers if len(numbers) == len(values) else None

    return read


def _first(*readers: Callable[[Any], Sizes | None]) -> Callable[[Any], Sizes | None]:
    """The sizes the first of ``readers`` finds (a family whose models name them differently)."""

    def read(config: Any) -> Sizes | None:
        return next((sizes for r in readers if (sizes := r(config)) is not None), None)

    return read


# Gated DeltaNet: key heads, value heads, key and value head sizes, kernel
def _gated_delta_net_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    k_heads, v_heads, k_dim, v_dim, kernel = sizes
    channels = 2 * k_heads * k_dim + v_heads * v_dim  # the convolution's: queries, keys and values
    return batch * (channels * kernel * itemsize + v_heads * k_dim * v_dim * _FP32)


def _gated_delta_net_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    k_heads, v_heads, k_dim, v_dim, _kernel = sizes
    key_width, value_width = k_heads * k_dim, v_heads * v_dim
    # in the model's dtype, per position: the projections of queries, keys, values and gates and their
    # reordered copies, the convolution's input, output and activation, queries and keys repeated to
    # every value head, the gated norm and its output
    projected = 2 * (2 * key_width + 2 * value_width) + 3 * (2 * key_width + value_width)
    projected += 2 * v_heads * k_dim + 4 * value_width
    # in fp32, per (padded) position and value head: a few copies of its query, key and value (cast,
    # padded, scaled, weighted by beta, decayed, solved for, the output; those the kernel rebinds freed),
    # and a prompt's chunk: pairwise decays, triangular system and attention, and their temporaries (a
    # row of the chunk each). Measured at Qwen3-Next's head sizes (128, 16 key and 32 value heads),
    # prompts of 64 to 2,048 tokens: the call's bound 1.9-2.5x the allocator's peak (1.5x for tiny
    # models' short prompts, padded to a chunk)
    padded = tokens if stepping else -(-tokens // _CHUNK) * _CHUNK
    per_head = 6 * (k_dim + v_dim) + (0 if stepping else 6 * _CHUNK)
    # the recurrent state, and the copies an update makes (decayed, its products with the key and query)
    states = 5 * v_heads * k_dim * v_dim
    return batch * (tokens * projected * itemsize + (padded * v_heads * per_head + states) * _FP32)


# Kimi's delta attention: heads, head size, kernel
def _kda_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, head_dim, kernel = sizes
    channels = 3 * heads * head_dim  # the convolutions': queries, keys and values
    return batch * (channels * kernel * itemsize + heads * head_dim * head_dim * _FP32)


def _kda_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, _kernel = sizes
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
    return batch * (tokens * projected + padded * heads * per_head * _FP32 + states)


# LFM2's gated short convolutions over the hidden states: hidden size, kernel
def _short_conv_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    hidden, kernel = sizes
    return batch * hidden * kernel * itemsize  # the convolution's last inputs, no recurrent state


def _short_conv_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    # per position, in the model's dtype: the input projection (three widths), the gated input, the
    # convolution's output, the gated output, its copy and projection; twice over
    return batch * tokens * 2 * 8 * sizes[0] * itemsize


# Mamba: inner width, state size, kernel, time-step rank, heads (Zamba's; 1 elsewhere)
def _mamba_sizes(config: Any) -> Sizes | None:
    """Mamba's and Falcon-Mamba's names, or Jamba's and Zamba's (inner width: expand x hidden; Zamba
    splits it into heads that scan one after another); None for Mamba-2's groups of heads."""
    if any(_value(config, name) is not None for name in ("n_groups", "mamba_ngroups", "mamba_n_groups")):
        return None
    mamba = _named("intermediate_size", "state_size", "conv_kernel", "time_step_rank")(config)
    if mamba is not None:
        return (*mamba, 1)
    jamba = _named("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank", "hidden_size")(config)
    if jamba is None:
        return None
    expand, state, kernel, rank, hidden = jamba
    heads = _value(config, "n_mamba_heads") or 1
    return expand * hidden, state, kernel, rank, heads


def _mamba_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    inner, state, kernel, _rank, _heads = sizes
    return batch * inner * (kernel * itemsize + state * _FP32)


def _mamba_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    inner, state, _kernel, rank, heads = sizes
    # per position, in the model's dtype: the input projection (twice the inner width), the convolution's
    # input, output and activation, the time step and its projection (per head), the scan's output and
    # gate; twice
    projected = 2 * (10 * inner + 2 * heads * (rank + 2 * state)) * itemsize
    # in fp32: a prompt's discretised A, B and B times the input for every position (and the product
    # before A's exponential) of the head scanning, the time step and each position's output; a step's
    # state, copied a few times
    scanned = (4 * (inner // heads) * state + 4 * inner) * _FP32
    states = (6 if stepping else 3) * inner * state * _FP32
    return batch * (tokens * (projected + (0 if stepping else scanned)) + states)


# Mamba-2: heads, head size, state size, groups, kernel, chunk
def _mamba2_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, head_dim, state, groups, kernel, _chunk = sizes
    channels = heads * head_dim + 2 * groups * state  # the convolution's: the inner states, B and C
    return batch * (channels * kernel * itemsize + heads * head_dim * state * _FP32)


def _mamba2_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, state, groups, _kernel, chunk = sizes
    inner, channels = heads * head_dim, heads * head_dim + 2 * groups * state
    # per position, in the model's dtype: the input projection (gate, convolution's input, time steps),
    # the convolution's output and activation, the gated norm and its output
    projected = (2 * inner + 3 * channels + heads + 4 * inner) * itemsize
    states = 6 * heads * head_dim * state * _FP32  # the state, and the copies a step or a chunk makes
    if stepping:
        return batch * (tokens * projected + states)
    # a prompt's chunked scan, padded to whole chunks, in fp32, per position and head: a row of the chunk
    # for its decays, its products of C and B and their decayed copy (3 held at once: measured at Mamba-2
    # 130M's sizes), B and C repeated to every head and chunked (4), its inputs and outputs (cast,
    # scaled, chunked, the skip connection, within and across chunks: 7); one more of each; per chunk,
    # every head's state a few times over
    padded = -(-tokens // chunk) * chunk
    scanned = padded * heads * (8 * head_dim + 5 * state + 4 * chunk) * _FP32
    per_chunk = 4 * (padded // chunk + 1) * heads * head_dim * state * _FP32
    return batch * (tokens * projected + scanned + per_chunk + states)


# Lightning attention: heads, head size, block
def _lightning_sizes(config: Any) -> Sizes | None:
    """MiniMax's heads, head size (``head_dim``, else the hidden size's share) and block of positions."""
    if _value(config, "linear_attn_alpha_factor") is None:
        return None  # heads and a block size are common names (BigBird's): MiniMax's own factor marks it
    heads, hidden, block = (
        _value(config, name) for name in ("num_attention_heads", "hidden_size", "block_size")
    )
    if not (isinstance(heads, int) and isinstance(block, int) and heads > 0 and block > 0):
        return None
    head_dim = _value(config, "head_dim") or (hidden // heads if isinstance(hidden, int) else 0)
    return (heads, head_dim, block) if isinstance(head_dim, int) and head_dim > 0 else None


def _lightning_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, head_dim, _block = sizes
    return batch * heads * head_dim * head_dim * itemsize  # keys times values, decayed; no convolution


def _lightning_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, block = sizes
    width = heads * head_dim
    # per position, in the model's dtype: the fused projection of queries, keys and values, activated and
    # masked, every block's output kept, joined and reshaped, the gate and its product; the norm in fp32;
    # twice over
    projected = 2 * (16 * width * itemsize + 2 * width * _FP32)
    states = 5 * heads * head_dim * head_dim * itemsize  # the state, and the copies an update makes
    if stepping:
        return batch * (tokens * projected + states)
    # a prompt's block (later positions, one at a time, hold less): the pairwise weights of its positions
    # and their decayed copy per head, and a few copies of its queries, keys and values decayed
    rows = min(tokens, block)
    per_block = heads * (3 * rows * rows + 8 * rows * head_dim) * itemsize
    return batch * (tokens * projected + per_block + states)


# RG-LRU (RecurrentGemma's): its width, the convolution's width, the hidden size
def _rg_lru_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    width, kernel, hidden = sizes
    # its recurrent state in fp32 and its convolution's last inputs (set up at the hidden size, kept at the
    # width once a prompt ran), in the model's dtype: kept by its modules, not by the cache
    return batch * (width * _FP32 + max(width, hidden) * (kernel - 1) * itemsize)


def _rg_lru_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    width, _kernel, _hidden = sizes
    # per position: the two branches, the convolution's output, the gates (each twice: their products and
    # sigmoids), the recurrence's decay, its square and the normaliser, the gated and normalised inputs,
    # the scan's outputs and the gated output, counted in fp32; a position's state a few times over
    return batch * (tokens * 16 * width * _FP32 + 4 * width * _FP32)


# Zaya's compressed convolutional attention: the two kernels, query and key/value heads, head size
def _cca_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    first, second, heads, kv_heads, head_dim = sizes
    queries, keys = heads * head_dim, kv_heads * head_dim
    # the convolution's last inputs (queries and keys, over both kernels' reach) and the last position's
    # delayed half of the values, in the model's dtype
    return batch * ((queries + keys) * (first + second - 2) + keys // 2) * itemsize


def _cca_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    first, second, heads, kv_heads, head_dim = sizes
    queries, keys = heads * head_dim, kv_heads * head_dim
    # per position, in the model's dtype: the projections, their join, residuals (keys repeated to every
    # head), the join padded and through both convolutions, the queries and keys they give, the values'
    # halves and their join; twice over. Once a call: a copy of the grouped convolution's weight (a head's
    # channels to each channel), which the CPU kernel makes (measured: most of a decode step)
    per_position = 2 * (8 * (queries + keys) + 2 * queries + 4 * keys) * itemsize
    return batch * tokens * per_position + (queries + keys) * head_dim * second * itemsize


# the config attributes each family's models name their sizes by
_GATED_DELTA_NET = (
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim",
)  # fmt: skip
_MAMBA2 = (
    ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size"),  # Mamba-2
    ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "chunk_size"),  # Nemotron-H
    ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv", "mamba_chunk_size"),  # Bamba
    ("n_mamba_heads", "mamba_headdim", "mamba_d_state", "mamba_ngroups", "mamba_d_conv", "chunk_size"),  # Zamba 2
)  # fmt: skip
# the modules whose torch code is read, where their names share no ending
_MAMBA_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer"})
_MAMBA2_MIXERS = frozenset({
    "Mamba2Mixer", "NemotronHMamba2Mixer", "BambaMixer", "FalconH1Mixer", "GraniteMoeHybridMambaLayer",
    "Zamba2MambaMixer",
})  # fmt: skip
# the families, in the order their sizes are read (the first a config states is its)
_FAMILIES = (
    _Family(
        _named(*_GATED_DELTA_NET),
        lambda name: name.endswith("GatedDeltaNet"),
        _gated_delta_net_state,
        _gated_delta_net_computing,
    ),
    _Family(
        _named("hidden_size", "conv_L_cache"),
        lambda name: name.endswith("ShortConv"),
        _short_conv_state,
        _short_conv_computing,
    ),
    _Family(
        _named("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"),
        lambda name: name.endswith("DeltaAttention"),
        _kda_state,
        _kda_computing,
    ),
    _Family(
        _first(*(_named(*names) for names in _MAMBA2)),
        lambda name: name in _MAMBA2_MIXERS,
        _mamba2_state,
        _mamba2_computing,
    ),
    _Family(_mamba_sizes, lambda name: name in _MAMBA_MIXERS, _mamba_state, _mamba_computing),
    _Family(
        _named("lru_width", "conv1d_width", "hidden_size"),
        lambda name: name == "RecurrentGemmaRecurrentBlock",
        _rg_lru_state,
        _rg_lru_computing,
    ),
    _Family(
        _named("cca_time0", "cca_time1", "num_attention_heads", "num_key_value_heads", "head_dim"),
        lambda name: name == "ZayaCCAProjection",
        _cca_state,
        _cca_computing,
    ),
    _Family(
        _lightning_sizes,
        lambda name: name.endswith("LightningAttention"),
        _lightning_state,
        _lightning_computing,
    ),
)


_RWKV_STEP_COPIES = 12  # fp32 copies of one layer's attention state a position's update holds at once


def own_state_bytes(config: Any, batch: int, itemsize: int) -> int | None:
    """Bytes of the state RWKV keeps outside Transformers' caches for ``batch`` sequences, at any length;
    None for other models."""
    if _value(config, "model_type") != "rwkv":
        return None
    sizes = _named("hidden_size", "num_hidden_layers")(config)
    if sizes is None:
        return None
    hidden, layers = sizes
    return batch * hidden * layers * (2 * itemsize + 3 * _FP32)


def _family(config: Any) -> tuple[_Family, Sizes] | None:
    """The family ``config`` (a decoder's text config) states the sizes of, and those sizes."""
    return next(((f, sizes) for f in _FAMILIES if (sizes := f.sizes(config)) is not None), None)


def is_read(config: Any) -> bool:
    """Whether ``config``'s linear-attention layers are of a family this module sizes."""
    return _family(config) is not None


def state_bytes(config: Any, batch: int, itemsize: int) -> int | None:
    """Bytes one linear-attention layer's cache keeps for ``batch`` sequences (its convolution's inputs and
    its recurrent states), at any length; None where the config describes no family read here."""
    found = _family(config)
    return None if found is None else found[0].state(found[1], batch, itemsize)


def computing_bytes(
    model: nn.Module, config: Any, batch: int, tokens: int, itemsize: int, stepping: bool
) -> int | None:
    """What one linear-attention layer of ``model`` holds at most while it computes ``tokens`` positions
    of ``batch`` sequences eagerly, beside the model's dense per-token states (``stepping``: one position
    after cached ones, which the recurrent rule computes): 0 where the model has no such layer, None where
    its layers are not of one family whose config and modules are read here."""
    if model not in _module_names:
        _module_names[model] = frozenset(type(m).__name__ for m in model.modules())
    if own_state_bytes(config, batch, itemsize) is not None:
        width = _named("attention_hidden_size")(config)
        if width is None or "RwkvSelfAttention" not in _module_names[model]:
            return None
        return batch * width[0] * _RWKV_STEP_COPIES * _FP32
    present = [f for f in _FAMILIES if any(f.is_layer(name) for name in _module_names[model])]
    linear = bool(KINDS & set(_value(config, "layer_types") or ()))
    if not (linear or present):
        return 0
    found = _family(config)
    if not linear or found is None or present != [found[0]]:
        return None  # its layers' modules, or several families', are not those its config sizes
    family, sizes = found
    return family.computing(sizes, batch, tokens, itemsize, stepping)
