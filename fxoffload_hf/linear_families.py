"""The arithmetic of each linear-attention family ``linear_attention`` reads: its sizes from a config, the
bytes of the states its cache keeps, and what one such layer holds while Transformers' torch code computes
it (pure functions of sizes, measured against the allocator in ``tests/test_eager_memory.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FP32 = 4
CHUNK = 64  # the delta rules' chunk of positions (Gated DeltaNet's, Kimi's)

Sizes = tuple[int, ...]


def value(config: Any, name: str) -> Any:
    """``config.name``, or None where it is missing or differs by layer (Transformers' own error)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, not an AttributeError
        return None


def named(*names: str) -> Callable[[Any], Sizes | None]:
    """Sizes read from the config attributes ``names`` (all positive integers, else None)."""

    def read(config: Any) -> Sizes | None:
        values = [value(config, name) for name in names]
        numbers = tuple(v for v in values if isinstance(v, int) and v > 0)
        return numbers if len(numbers) == len(values) else None

    return read


def first(*readers: Callable[[Any], Sizes | None]) -> Callable[[Any], Sizes | None]:
    """The sizes the first of ``readers`` finds (a family whose models name them differently)."""

    def read(config: Any) -> Sizes | None:
        return next((sizes for r in readers if (sizes := r(config)) is not None), None)

    return read


# Gated DeltaNet: key heads, value heads, key and value head sizes, kernel
def whole_chunks(tokens: int, chunk: int) -> int:
    """``tokens`` padded to whole chunks, as a chunked kernel pads a prompt."""
    return -(-tokens // chunk) * chunk


def gated_delta_net_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    k_heads, v_heads, k_dim, v_dim, kernel = sizes
    channels = 2 * k_heads * k_dim + v_heads * v_dim  # the convolution's: queries, keys and values
    return batch * (channels * kernel * itemsize + v_heads * k_dim * v_dim * FP32)


def gated_delta_net_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
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
    padded = tokens if stepping else whole_chunks(tokens, CHUNK)
    per_head = 6 * (k_dim + v_dim) + (0 if stepping else 6 * CHUNK)
    # the recurrent state, and the copies an update makes (decayed, its products with the key and query)
    states = 5 * v_heads * k_dim * v_dim
    return batch * (tokens * projected * itemsize + (padded * v_heads * per_head + states) * FP32)


# Kimi's delta attention: heads, head size, kernel
def kda_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, head_dim, kernel = sizes
    channels = 3 * heads * head_dim  # the convolutions': queries, keys and values
    return batch * (channels * kernel * itemsize + heads * head_dim * head_dim * FP32)


def kda_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, _kernel = sizes
    width = heads * head_dim
    # per position, in the model's dtype: the projections of queries, keys and values, their convolutions'
    # outputs and activations, the decay's and gate's projections, the gated norm; twice over
    projected = 2 * 16 * width * itemsize
    states = 5 * heads * head_dim * head_dim * FP32  # the state, and the copies an update makes
    if stepping:
        return batch * (tokens * (projected + 16 * width * FP32) + states)
    # a prompt's chunks, in fp32, per padded position and head: a dozen copies of its query, key, value and
    # decay, and the chunk's decays per key channel (chunk x head size: the decay mask, the products of
    # keys with it, the intra-chunk attention in the loop) besides its triangular system
    padded = whole_chunks(tokens, CHUNK)
    per_head = 16 * head_dim + 4 * CHUNK * head_dim + 4 * CHUNK
    return batch * (tokens * projected + padded * heads * per_head * FP32 + states)


# LFM2's gated short convolutions over the hidden states: hidden size, kernel
def short_conv_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    hidden, kernel = sizes
    return batch * hidden * kernel * itemsize  # the convolution's last inputs, no recurrent state


def short_conv_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    # per position, in the model's dtype: the input projection (three widths), the gated input, the
    # convolution's output, the gated output, its copy and projection; twice over
    return batch * tokens * 2 * 8 * sizes[0] * itemsize


# Mamba: inner width, state size, kernel, time-step rank, heads (Zamba's; 1 elsewhere)
def mamba_sizes(config: Any) -> Sizes | None:
    """Mamba's and Falcon-Mamba's names, or Jamba's and Zamba's (inner width: expand x hidden; Zamba
    splits it into heads that scan one after another); None for Mamba-2's groups of heads."""
    if any(value(config, name) is not None for name in ("n_groups", "mamba_ngroups", "mamba_n_groups")):
        return None
    mamba = named("intermediate_size", "state_size", "conv_kernel", "time_step_rank")(config)
    if mamba is not None:
        return (*mamba, 1)
    jamba = named("mamba_expand", "mamba_d_state", "mamba_d_conv", "mamba_dt_rank", "hidden_size")(config)
    if jamba is None:
        return None
    expand, state, kernel, rank, hidden = jamba
    heads = value(config, "n_mamba_heads") or 1
    return expand * hidden, state, kernel, rank, heads


def mamba_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    inner, state, kernel, _rank, _heads = sizes
    return batch * inner * (kernel * itemsize + state * FP32)


def mamba_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    inner, state, _kernel, rank, heads = sizes
    # per position, in the model's dtype: the input projection (twice the inner width), the convolution's
    # input, output and activation, the time step and its projection (per head), the scan's output and
    # gate; twice
    projected = 2 * (10 * inner + 2 * heads * (rank + 2 * state)) * itemsize
    # in fp32: a prompt's discretised A, B and B times the input for every position (and the product
    # before A's exponential) of the head scanning, the time step and each position's output; a step's
    # state, copied a few times
    scanned = (4 * (inner // heads) * state + 4 * inner) * FP32
    states = (6 if stepping else 3) * inner * state * FP32
    return batch * (tokens * (projected + (0 if stepping else scanned)) + states)


# Mamba-2: heads, head size, state size, groups, kernel, chunk
def mamba2_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, head_dim, state, groups, kernel, _chunk = sizes
    channels = heads * head_dim + 2 * groups * state  # the convolution's: the inner states, B and C
    return batch * (channels * kernel * itemsize + heads * head_dim * state * FP32)


def mamba2_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, state, groups, _kernel, chunk = sizes
    inner, channels = heads * head_dim, heads * head_dim + 2 * groups * state
    # per position, in the model's dtype: the input projection (gate, convolution's input, time steps),
    # the convolution's output and activation, the gated norm and its output
    projected = (2 * inner + 3 * channels + heads + 4 * inner) * itemsize
    states = 6 * heads * head_dim * state * FP32  # the state, and the copies a step or a chunk makes
    if stepping:
        return batch * (tokens * projected + states)
    # a prompt's chunked scan, padded to whole chunks, in fp32, per position and head: a row of the chunk
    # for its decays, its products of C and B and their decayed copy (3 held at once: measured at Mamba-2
    # 130M's sizes), B and C repeated to every head and chunked (4), its inputs and outputs (cast,
    # scaled, chunked, the skip connection, within and across chunks: 7); one more of each; per chunk,
    # every head's state a few times over
    padded = whole_chunks(tokens, chunk)
    scanned = padded * heads * (8 * head_dim + 5 * state + 4 * chunk) * FP32
    per_chunk = 4 * (padded // chunk + 1) * heads * head_dim * state * FP32
    return batch * (tokens * projected + scanned + per_chunk + states)


# Lightning attention: heads, head size, block
def lightning_sizes(config: Any) -> Sizes | None:
    """MiniMax's heads, head size (``head_dim``, else the hidden size's share) and block of positions."""
    if value(config, "linear_attn_alpha_factor") is None:
        return None  # heads and a block size are common names (BigBird's): MiniMax's own factor marks it
    heads, hidden, block = (
        value(config, name) for name in ("num_attention_heads", "hidden_size", "block_size")
    )
    if not (isinstance(heads, int) and isinstance(block, int) and heads > 0 and block > 0):
        return None
    head_dim = value(config, "head_dim") or (hidden // heads if isinstance(hidden, int) else 0)
    return (heads, head_dim, block) if isinstance(head_dim, int) and head_dim > 0 else None


def lightning_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, head_dim, _block = sizes
    return batch * heads * head_dim * head_dim * itemsize  # keys times values, decayed; no convolution


def lightning_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, head_dim, block = sizes
    width = heads * head_dim
    # per position, in the model's dtype: the fused projection of queries, keys and values, activated and
    # masked, every block's output kept, joined and reshaped, the gate and its product; the norm in fp32;
    # twice over
    projected = 2 * (16 * width * itemsize + 2 * width * FP32)
    states = 5 * heads * head_dim * head_dim * itemsize  # the state, and the copies an update makes
    if stepping:
        return batch * (tokens * projected + states)
    # a prompt's block (later positions, one at a time, hold less): the pairwise weights of its positions
    # and their decayed copy per head, and a few copies of its queries, keys and values decayed
    rows = min(tokens, block)
    per_block = heads * (3 * rows * rows + 8 * rows * head_dim) * itemsize
    return batch * (tokens * projected + per_block + states)


# RG-LRU (RecurrentGemma's): its width, the convolution's width, the hidden size
def rg_lru_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    width, kernel, hidden = sizes
    # its recurrent state in fp32 and its convolution's last inputs (set up at the hidden size, kept at the
    # width once a prompt ran), in the model's dtype: kept by its modules, not by the cache
    return batch * (width * FP32 + max(width, hidden) * (kernel - 1) * itemsize)


def rg_lru_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    width, _kernel, _hidden = sizes
    # per position: the two branches, the convolution's output, the gates (each twice: their products and
    # sigmoids), the recurrence's decay, its square and the normaliser, the gated and normalised inputs,
    # the scan's outputs and the gated output, counted in fp32; a position's state a few times over
    return batch * (tokens * 16 * width * FP32 + 4 * width * FP32)


# Zaya's compressed convolutional attention: the two kernels, query and key/value heads, head size
def cca_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    first, second, heads, kv_heads, head_dim = sizes
    queries, keys = heads * head_dim, kv_heads * head_dim
    # the convolution's last inputs (queries and keys, over both kernels' reach) and the last position's
    # delayed half of the values, in the model's dtype
    return batch * ((queries + keys) * (first + second - 2) + keys // 2) * itemsize


def cca_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    first, second, heads, kv_heads, head_dim = sizes
    queries, keys = heads * head_dim, kv_heads * head_dim
    # per position, in the model's dtype: the projections, their join, residuals (keys repeated to every
    # head), the join padded and through both convolutions, the queries and keys they give, the values'
    # halves and their join; twice over. Once a call: a copy of the grouped convolution's weight (a head's
    # channels to each channel), which the CPU kernel makes (measured: most of a decode step)
    per_position = 2 * (8 * (queries + keys) + 2 * queries + 4 * keys) * itemsize
    return batch * tokens * per_position + (queries + keys) * head_dim * second * itemsize


# Inkling's and Inkling 2's short convolutions (four per layer, in fp32: keys, values, and the hidden states
# before attention and before the MLP; Inkling 2's full-attention layers weight their keys' and values'
# taps per token): hidden size, kernel, the widest keys of a layer (sliding layers have heads of their own)
INKLING_TYPES = frozenset({"inkling_text", "inkling2_text"})  # not the looped one: layers run again


def inkling_sizes(config: Any) -> Sizes | None:
    if value(config, "model_type") not in INKLING_TYPES:
        return None
    sizes = named("hidden_size", "conv_kernel_size", "num_key_value_heads", "head_dim")(config)
    sliding = named("swa_num_key_value_heads", "swa_head_dim")(config)
    if sizes is None or sliding is None:
        return None
    hidden, kernel, kv_heads, head_dim = sizes
    return hidden, kernel, max(kv_heads * head_dim, sliding[0] * sliding[1])


def inkling_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    hidden, kernel, keys = sizes
    return batch * 2 * (hidden + keys) * kernel * FP32  # the last inputs of each, a whole kernel's


def inkling_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    hidden, kernel, keys = sizes
    # per position and convolution, in fp32: its input cast, masked and transposed, the output padded by
    # the kernel and cut, transposed back, the residual sum and its cast; the two over the hidden states
    # run one after the other, the keys' and values' together; Inkling 2's per-token taps: each position's
    # window of the kernel, flipped, and weighted, for keys and values
    return batch * (tokens + kernel) * (8 * (hidden + 2 * keys) + 4 * kernel * keys) * FP32


# Models whose whole state one argument of their own keeps, outside Transformers' caches (sizes for the
# whole model). RWKV: hidden size, layers, attention width, and the widest projection its rescaling
# divides (0 where it does not: ``weight_rescaling`` then divides a copy of it at each call)
def rwkv_sizes(config: Any) -> Sizes | None:
    if value(config, "model_type") != "rwkv":
        return None
    sizes = named("hidden_size", "num_hidden_layers", "attention_hidden_size")(config)
    if sizes is None:
        return None
    hidden, layers, width = sizes
    every = value(config, "rescale_every")
    inner = value(config, "intermediate_size") or 4 * hidden
    divided = hidden * max(width, inner) if isinstance(every, int) and 0 < every < layers else 0
    return hidden, layers, width, divided


def rwkv_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    hidden, layers, _width, _divided = sizes
    # per layer, the last inputs of its attention and feed-forward in the model's dtype, the attention's
    # numerator, denominator and running maximum in fp32 (all five as wide as the hidden states)
    return batch * hidden * layers * (2 * itemsize + 3 * FP32)


RWKV_STEP_COPIES = 12  # fp32 copies of one layer's attention state a position's update holds at once


def rwkv_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    _hidden, _layers, width, divided = sizes
    # a prompt runs one position at a time: its per-token states are the dense bound's; and the divided
    # copy of a rescaled projection's weight
    return batch * width * RWKV_STEP_COPIES * FP32 + divided * itemsize


# xLSTM (its mLSTM layers' states in its own cache, ``xLSTMCache``): heads, query/key and value head
# sizes, layers, chunk
def xlstm_sizes(config: Any) -> Sizes | None:
    if value(config, "model_type") != "xlstm":
        return None
    return named("num_heads", "qk_head_dim", "v_head_dim", "num_hidden_layers", "chunk_size")(config)


def xlstm_state(sizes: Sizes, batch: int, itemsize: int) -> int:
    heads, qk, v, layers, _chunk = sizes
    # per layer and head: the matrix memory, its normaliser and its stabiliser, in the model's dtype
    return batch * layers * heads * (qk * v + qk + 1) * itemsize


def xlstm_computing(sizes: Sizes, batch: int, tokens: int, itemsize: int, stepping: bool) -> int:
    heads, qk, v, _layers, chunk = sizes
    states = 6 * batch * heads * (qk * v + qk + 1) * FP32  # a layer's state, and the copies a step makes
    if stepping:
        return states
    # a prompt's chunkwise kernel, padded to whole chunks, in fp32, per position and head: the gates'
    # pairwise terms within its chunk, and the queries, keys and values a few times over
    padded = whole_chunks(tokens, chunk)
    return batch * padded * heads * (8 * chunk + 8 * (qk + v)) * FP32 + states
