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
convolution's last inputs and a delayed half of the values beside its keys and values, Inkling's four short
convolutions theirs (Inkling 2's too, some of whose taps are weighted per token), in fp32. Looped Inkling 2
(layers run again, with caches of their own) is not read.

RWKV and xLSTM keep their states outside Transformers' caches, whatever the length (``own_state_bytes``):
RWKV in its ``state`` argument (five tensors of every layer: the last inputs of its attention and
feed-forward in the model's dtype, the attention's numerator, denominator and running maximum in fp32; a
prompt runs one position at a time, so a layer holds its per-token states, the dense bound's, and a few
copies of its state), xLSTM in its own ``xLSTMCache`` (per mLSTM layer and head a matrix memory, its
normaliser and stabiliser, in the model's dtype; a prompt runs through a chunkwise kernel, padded to whole
chunks, with each chunk's pairwise gate terms).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from fxoffload_hf import linear_families as families
from fxoffload_hf.linear_families import Sizes

# Transformers' layer types of such layers: alone, beside attention in the same layer (Falcon-H1's), or
# a short convolution
KINDS = frozenset({"linear_attention", "hybrid", "hybrid_sliding", "conv"})
# per model: the class names of its modules
_module_names: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Family:
    """One family of layers: its sizes from a config (None where the config does not state them), whether
    a module's class is one of its layers, its cache's bytes (sizes, batch, itemsize) and what one layer
    holds computing (sizes, batch, tokens, itemsize, stepping)."""

    sizes: Callable[[Any], Sizes | None]
    is_layer: Callable[[str], bool]
    state: Callable[[Sizes, int, int], int]
    computing: Callable[[Sizes, int, int, int, bool], int]


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
_INKLING_CONVOLUTIONS = frozenset({
    "InklingShortConvolution", "Inkling2ShortConvolution", "Inkling2DynamicShortConvolution",
})  # fmt: skip
# the families, in the order their sizes are read (the first a config states is its)
_FAMILIES = (
    _Family(
        families.named(*_GATED_DELTA_NET),
        lambda name: name.endswith("GatedDeltaNet"),
        families.gated_delta_net_state,
        families.gated_delta_net_computing,
    ),
    _Family(
        families.named("hidden_size", "conv_L_cache"),
        lambda name: name.endswith("ShortConv"),
        families.short_conv_state,
        families.short_conv_computing,
    ),
    _Family(
        families.named("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"),
        lambda name: name.endswith("DeltaAttention"),
        families.kda_state,
        families.kda_computing,
    ),
    _Family(
        families.first(*(families.named(*names) for names in _MAMBA2)),
        lambda name: name in _MAMBA2_MIXERS,
        families.mamba2_state,
        families.mamba2_computing,
    ),
    _Family(
        families.mamba_sizes,
        lambda name: name in _MAMBA_MIXERS,
        families.mamba_state,
        families.mamba_computing,
    ),
    _Family(
        families.named("lru_width", "conv1d_width", "hidden_size"),
        lambda name: name == "RecurrentGemmaRecurrentBlock",
        families.rg_lru_state,
        families.rg_lru_computing,
    ),
    _Family(
        families.named("cca_time0", "cca_time1", "num_attention_heads", "num_key_value_heads", "head_dim"),
        lambda name: name == "ZayaCCAProjection",
        families.cca_state,
        families.cca_computing,
    ),
    _Family(
        families.inkling_sizes,
        lambda name: name in _INKLING_CONVOLUTIONS,
        families.inkling_state,
        families.inkling_computing,
    ),
    _Family(
        families.lightning_sizes,
        lambda name: name.endswith("LightningAttention"),
        families.lightning_state,
        families.lightning_computing,
    ),
)


# models whose whole state one argument of their own keeps (RWKV's ``state``, xLSTM's ``xLSTMCache``): their
# sizes are the whole model's
_OWN_STATE = (
    _Family(
        families.rwkv_sizes,
        lambda name: name == "RwkvSelfAttention",
        families.rwkv_state,
        families.rwkv_computing,
    ),
    _Family(
        families.xlstm_sizes,
        lambda name: name == "xLSTMLayer",
        families.xlstm_state,
        families.xlstm_computing,
    ),
)


def _family(config: Any, candidates: tuple[_Family, ...] = _FAMILIES) -> tuple[_Family, Sizes] | None:
    """The first of ``candidates`` whose sizes ``config`` (a decoder's text config) states, and those sizes."""
    return next(((f, sizes) for f in candidates if (sizes := f.sizes(config)) is not None), None)


def keeps_own_state(config: Any) -> bool:
    """Whether the model keeps its state outside Transformers' caches (RWKV, xLSTM)."""
    return _family(config, _OWN_STATE) is not None


def own_state_bytes(config: Any, batch: int, itemsize: int) -> int | None:
    """Bytes of the state a model keeps outside Transformers' caches for ``batch`` sequences, at any length
    (RWKV's, xLSTM's); None for other models."""
    found = _family(config, _OWN_STATE)
    return None if found is None else found[0].state(found[1], batch, itemsize)


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
    own = _family(config, _OWN_STATE)
    if own is not None:
        family, sizes = own
        if not any(family.is_layer(name) for name in _module_names[model]):
            return None
        return family.computing(sizes, batch, tokens, itemsize, stepping)
    present = [f for f in _FAMILIES if any(f.is_layer(name) for name in _module_names[model])]
    linear = bool(KINDS & set(families.value(config, "layer_types") or ()))
    if not (linear or present):
        return 0
    found = _family(config)
    if not linear or found is None or present != [found[0]]:
        return None  # its layers' modules, or several families', are not those its config sizes
    family, sizes = found
    return family.computing(sizes, batch, tokens, itemsize, stepping)
