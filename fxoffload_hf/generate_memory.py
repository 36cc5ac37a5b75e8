"""``generate``'s KV cache at its final length, counted before the first token: a call whose cache cannot
fit the budget is refused before any weight is read, not at the decode step that outgrows it.

The cache is predicted from the config (``kv_cache.predicted_cache_bytes``: each layer's keys and values
at full attention or over its sliding window, as Transformers reads the layer types) for the batch and
the final length the call asks for. Only where that is what the cache holds: a decoder whose
``forward`` takes a cache and whose layers are all of those two kinds (no state-space layers, no
compressed latent or shared caches). Elsewhere nothing is predicted, and the engine measures each call
as before (``activations``).
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fxoffload_hf.kv_cache import cache_positions, predicted_cache_bytes

_CACHE_ARGUMENTS = {"cache", "past_key_values"}  # Transformers 5.25's name, and earlier versions'


def predictable_cache(model: nn.Module) -> bool:
    """Whether the bytes of ``model``'s generate cache follow from its config (``kv_cache``)."""
    return _decoder_with_cache(model) and cache_positions(model.config, 1) is not None


def _decoder_with_cache(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder with a config whose ``forward`` takes a cache."""
    forward = getattr(model, "forward", None)
    if forward is None or not _CACHE_ARGUMENTS & set(inspect.signature(forward).parameters):
        return False
    config = getattr(model, "config", None)
    return config is not None and not getattr(config, "is_encoder_decoder", False)


def final_kv_bytes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the KV cache at the end of ``model.generate(*args, **kwargs)``; 0 where not predicted
    (``kv_cache.predicted_cache_bytes`` reads the layer kinds)."""
    if not _decoder_with_cache(model):
        return 0
    ids = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return 0  # embeddings, or another modality's inputs: the length is not the prompt's
    settings = copy.deepcopy(kwargs.get("generation_config") or getattr(model, "generation_config", None))
    if settings is None:
        return 0
    settings.update(**{k: v for k, v in kwargs.items() if hasattr(settings, k)})
    length = ids.shape[1]
    new = settings.max_new_tokens if settings.max_new_tokens is not None else settings.max_length - length
    sequences = ids.shape[0] * max(settings.num_beams or 1, settings.num_return_sequences or 1)
    itemsize = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    # the last new token is returned, never fed back: the cache holds one position fewer than the output
    positions = length + max(new, 1) - 1
    return predicted_cache_bytes(model.config, sequences, positions, itemsize) or 0


def counting_kv(
    model: nn.Module, generate: Callable[..., Any], expect: Callable[[int], None]
) -> Callable[..., Any]:
    """``generate`` that first tells ``expect`` the bytes its KV cache will reach (when predicted)."""

    @functools.wraps(generate)
    def run(*args: Any, **kwargs: Any) -> Any:
        need = final_kv_bytes(model, args, kwargs)
        if need:
            expect(need)
        return generate(*args, **kwargs)

    return run
