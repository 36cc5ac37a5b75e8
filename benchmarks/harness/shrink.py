"""A tiny copy of any transformers config: the same architecture, with widths, depths and tables shrunk.

The rules are generic (by key name), applied level by level: a sub-config (``text_config``,
``vision_config``, ...) is shrunk on its own and handed to its parent's constructor as an object. Only the
keys a rule changes are passed to the constructor, so whatever a config derives from them (``qk_head_dim``,
``layer_types`` from ``num_hidden_layers``) is derived again. Layer depth keeps every kind of layer a
per-layer list names (sliding and full attention, mamba and attention, dense and MoE) when that takes at
most ``MAX_LAYERS`` layers.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from typing import Any

LAYERS = 3
MAX_LAYERS = 8
EXPERTS = 4
EXPERTS_PER_TOKEN = 2
POSITIONS = 512
STATE = 16


@dataclass(frozen=True)
class Shape:
    """The widths a config is shrunk to: tiny by default; ``--hidden``/``--vocab`` of the sweeps give a
    user's shapes (a vocabulary large against the hidden size) with the same rules."""

    hidden: int = 128
    heads: int = 4
    vocab: int = 1000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def with_sizes(self, hidden: int | None = None, vocab: int | None = None) -> Shape:
        """This shape with ``hidden`` (heads of 64 from 256 up, as most checkpoints have) and ``vocab``
        where given."""
        shape = self if vocab is None else replace(self, vocab=vocab)
        if hidden is None:
            return shape
        return replace(shape, hidden=hidden, heads=max(self.heads, hidden // 64))


TINY = Shape()
SHAPE_VARIABLE = "FXOFFLOAD_BENCH_SHAPE"  # a sweep's shape, for its children (``Shape`` as JSON)
DTYPE_VARIABLE = "FXOFFLOAD_BENCH_DTYPE"  # and its models' dtype (a torch dtype's name; float32 unset)
BATCH_VARIABLE = "FXOFFLOAD_BENCH_BATCH"  # and its prompts a call (1 unset)


def dtype_from_environment() -> Any:
    """The torch dtype a sweep's parent set for its children's models; float32 where none was set."""
    import torch

    return getattr(torch, os.environ.get(DTYPE_VARIABLE, "float32"))


def batch_from_environment() -> int:
    """How many prompts of different lengths a sweep's parent asked each call to carry; 1 where unset."""
    return int(os.environ.get(BATCH_VARIABLE, "1"))


def shape_from_environment() -> Shape:
    """The shape a sweep's parent set for its children; ``TINY`` where none was set."""
    value = os.environ.get(SHAPE_VARIABLE)
    return Shape(**json.loads(value)) if value else TINY


# ordered (the first present is the level's own width, depth, heads): a set's order would vary by process
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "model_dim", "word_embed_proj_dim")
LAYER_KEYS = (
    "num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
    "num_decoder_layers", "num_encoder_layers",
)  # fmt: skip
HEAD_KEYS = (
    "num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
    "encoder_attention_heads", "attention_heads",
)  # fmt: skip
EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "zero_expert_num"}
TOP_K_KEYS = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k"}
POSITION_KEYS = {
    "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
    "max_target_positions", "max_source_positions", "seq_length",
}  # fmt: skip
_PERIODS = {"attn_layer_period", "expert_layer_period", "moe_layer_period"}
STATE_KEYS = {"state_size", "mamba_d_state", "ssm_state_size", "d_state"}
ONE_KEYS = {"n_group", "topk_group", "num_expert_group", "n_groups", "mamba_n_groups"}
# widths that scale with the hidden size (ratios kept): feed-forward sizes, low ranks
WIDTH = re.compile(r"intermediate|ffn|(^|_)d_ff$|n_inner|lora_rank|ffn_hidden|feed_forward_size|(^|_)dff$")
HEAD_DIM_KEY = re.compile(
    r"head_dim$|^d_kv$|^kv_channels$|^attention_head_dim$|^head_size$|_head_size$|^rotary_dim$"
)
KV_HEADS_KEY = re.compile(r"(key_value|kv)_heads$|^multi_query_group_num$|^num_query_groups$")
OTHER_HEADS_KEY = re.compile(r"(^|_)(n|num)_.*heads$|_n_heads$")
TOKEN_ID_KEY = re.compile(r"_token_(id|ids|index)$")
INDEX_LIST_KEY = re.compile(r"layers$|_idxs$|_ids$|layer_indices$")
SEQUENCE_KEY = re.compile(r"layer|pattern|types|block_type")


def shrink_config(config: Any, shape: Shape = TINY) -> Any:
    """A new config of ``config``'s class at ``shape``'s widths (see the module docstring). Raises what its
    constructor raises."""
    return type(config)(**overrides(config, shape))


def overrides(config: Any, shape: Shape = TINY) -> dict[str, Any]:
    """The constructor keywords that shrink ``config`` to ``shape``: every key a rule changes, sub-configs
    shrunk."""
    from transformers import PreTrainedConfig

    values = config.to_dict()
    changed: dict[str, Any] = {}
    for key in values:
        sub = _attribute(config, key)
        if isinstance(sub, PreTrainedConfig):
            changed[key] = shrink_config(sub, shape)
    flat = {k: v for k, v in values.items() if k not in changed}
    changed.update(_level(flat, shape))
    return changed


def _attribute(config: Any, key: str) -> Any:
    try:
        return getattr(config, key)
    except Exception:  # noqa: BLE001 - heterogeneous configs refuse global reads of per-layer keys
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _level(values: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """Rules for one config level (no sub-configs)."""
    out: dict[str, Any] = {}
    hidden = next((values[k] for k in HIDDEN_KEYS if _is_int(values.get(k))), None)
    heads = next((values[k] for k in HEAD_KEYS if _is_int(values.get(k))), None)
    depth = next((values[k] for k in LAYER_KEYS if _is_int(values.get(k))), None)
    layers = _depth(values, depth)
    for key, value in values.items():
        new = _rule(key, value, shape, hidden=hidden, heads=heads, layers=layers)
        if new is not None and new != value:
            out[key] = new
    if depth is not None:
        out.update(_per_layer(values, depth, layers))
    out.update(_token_ids(values, int(out.get("vocab_size", values.get("vocab_size") or shape.vocab))))
    out.update(_ssm_heads(values, out))
    out.update(_latent_attention(values, out))
    return out


def _rule(key: str, value: Any, shape: Shape, *, hidden: int | None, heads: int | None, layers: int) -> Any:
    """The new value of one key, or None to keep it."""
    if not _is_int(value) or value <= 0:
        return None
    if key in HIDDEN_KEYS:
        return min(value, shape.hidden)
    if key in LAYER_KEYS:
        # encoder and decoder alike: some models size their cache by one and run the other
        return layers if value > 1 else None
    if key in HEAD_KEYS:
        return min(value, shape.heads)
    if KV_HEADS_KEY.search(key):
        return _ratio(value, heads, shape)
    if key in EXPERT_KEYS:
        return min(value, EXPERTS)
    if key in TOP_K_KEYS:
        return min(value, EXPERTS_PER_TOKEN)
    if key in POSITION_KEYS or key == "sliding_window":
        return min(value, POSITIONS)
    if key == "vocab_size" or key.endswith("_vocab_size"):
        return min(value, shape.vocab)
    if key in STATE_KEYS:
        return min(value, STATE)
    if key in ONE_KEYS or key in ("first_k_dense_replace", "n_shared_experts"):
        return min(value, 1)
    if key.endswith("_period"):
        return min(value, 2)
    if key.endswith("_offset") and key.replace("_offset", "_period") in _PERIODS:
        return min(value, 1)
    if key in ("time_step_rank", "mamba_dt_rank"):
        return max(shape.hidden // 16, 1)
    if key == "qk_rope_head_dim":
        return min(value, shape.head_dim // 2)
    if HEAD_DIM_KEY.search(key):
        return min(value, shape.head_dim)
    if OTHER_HEADS_KEY.search(key):
        return _ratio(value, heads, shape)
    if WIDTH.search(key) and hidden:
        return max(16, round(value * shape.hidden / hidden / 16) * 16)
    return None


def _ratio(value: int, heads: int | None, shape: Shape) -> int:
    """A count of heads kept in its ratio to the attention heads (at least one)."""
    if not heads:
        return min(value, shape.heads)
    return max(1, min(value * shape.heads // heads, 2 * shape.heads))


def _sequences(values: dict[str, Any], depth: int) -> dict[str, Any]:
    """The per-layer lists and strings of a level: one entry per layer."""
    return {
        k: v
        for k, v in values.items()
        if isinstance(v, list | tuple | str) and len(v) == depth and depth > 1 and SEQUENCE_KEY.search(k)
    }


def _depth(values: dict[str, Any], depth: int | None) -> int:
    """Layers to keep: ``LAYERS``, or the fewest that hold every kind a per-layer sequence names (two
    periods where layer kinds repeat with a period)."""
    if depth is None:
        return LAYERS
    need = 6 if any(_is_int(values.get(k)) for k in _PERIODS) else LAYERS
    for seq in _sequences(values, depth).values():
        kinds = {repr(x) for x in seq}
        for n in range(1, len(seq) + 1):
            if {repr(x) for x in seq[:n]} == kinds:
                need = max(need, n)
                break
    return min(depth, need, MAX_LAYERS)


def _per_layer(values: dict[str, Any], depth: int, layers: int) -> dict[str, Any]:
    """Per-layer sequences cut to ``layers`` (left to be derived again where periods make them); lists of
    layer indices keep those below it."""
    periodic = any(_is_int(values.get(k)) for k in _PERIODS)
    out: dict[str, Any] = {} if periodic else {k: v[:layers] for k, v in _sequences(values, depth).items()}
    for key, value in values.items():
        if key in out or not isinstance(value, list) or not INDEX_LIST_KEY.search(key):
            continue
        if value and all(_is_int(i) for i in value) and not TOKEN_ID_KEY.search(key):
            # the kind of layer these indices name stays in the model
            out[key] = [i for i in value if i < layers] or [layers - 1]
    return out


def _token_ids(values: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Special token ids moved inside the shrunk vocabulary (distinct ids stay distinct)."""
    moved: dict[int, int] = {}

    def inside(i: int) -> int:
        if i < vocab:
            return i
        return moved.setdefault(i, vocab - 1 - len(moved))

    out: dict[str, Any] = {}
    for key, value in values.items():
        if not TOKEN_ID_KEY.search(key) and key not in ("image_token_index", "boi_token_index"):
            continue
        if _is_int(value) and value >= vocab:
            out[key] = inside(value)
        elif isinstance(value, list) and any(_is_int(i) and i >= vocab for i in value):
            out[key] = [inside(i) if _is_int(i) else i for i in value]
    return out


def _ssm_heads(values: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Mamba-2 style mixers: heads x head size must equal expand x hidden; the heads follow the rest."""
    for heads_key, dim_key, expand_key in (
        ("num_heads", "head_dim", "expand"),
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("mamba_num_heads", "mamba_head_dim", "mamba_expand"),
        ("mamba_num_heads", "mamba_head_dim", "expand"),
    ):
        if all(_is_int(values.get(k)) for k in (heads_key, dim_key, expand_key)):
            hidden = out.get("hidden_size", values.get("hidden_size"))
            dim = out.get(dim_key, values[dim_key])
            if _is_int(hidden) and dim:
                return {heads_key: max(1, values[expand_key] * hidden // dim)}
    return {}


def _latent_attention(values: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention: ``qk_head_dim`` is nope + rope; a ``head_dim`` that was the rope part
    stays the rope part."""
    if not all(_is_int(values.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim")):
        return {}
    nope = out.get("qk_nope_head_dim", values["qk_nope_head_dim"])
    rope = out.get("qk_rope_head_dim", values["qk_rope_head_dim"])
    fixed: dict[str, Any] = {}
    if "qk_head_dim" in values:
        fixed["qk_head_dim"] = nope + rope
    if values.get("head_dim") == values["qk_rope_head_dim"]:
        fixed["head_dim"] = rope
    return fixed
