"""``generate``'s KV cache written in place into storage reserved for its final length: held once, not twice.

Transformers' ``DynamicLayer`` grows a layer's keys and values by concatenation, so every step allocates
the layer's whole cache again and copies it. Run eagerly the old one is freed at once; in a captured graph
it is not (the cache object holds every old layer until the graph returns), so a decode step holds the
cache twice, and copies all of it. ``ReservedLayer`` reserves each layer's storage for the length the call
can reach (``generate``'s own ``max_cache_length``) at its first update, writes each step's keys and
values into it in place, and hands attention views of the filled part: the same values in the same
shapes, so attention computes what it computes over the concatenated cache (tokens and scores equal bit
for bit: ``tests/test_reserved_cache.py``). On CUDA, where attention kernels are chosen by strides too and
no GPU has checked views, attention is given a contiguous copy of each layer instead, as concatenation
lays it out: one layer's copy lives at a time, not the whole cache. Anything that reshapes the cache (beam reordering, cropping, a
batch selection, more tokens than reserved) turns the layer back into a plain ``DynamicLayer`` first.

Offloaded models reserve their default cache (``reserve_default_cache``, installed by ``entries``): a
``DynamicCache`` of plain full-attention layers that ``generate`` makes itself. A cache the caller
passes, another ``cache_implementation``, sliding-window or other kinds of layers stay as they are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from fxoffload_hf.kv_cache import cache_positions

_CACHE_KWARGS = ("cache", "past_key_values")  # Transformers 5.25's name, and earlier versions'


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of storage reserved for ``capacity`` positions."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        super().__init__()
        # the capacity as a size, not a Python number: a captured graph reads it as a size symbol, so a
        # later call with another length reuses the graph instead of specialising on this one
        self._room: torch.Tensor | None = torch.empty(capacity, 0, device=device)
        # attention over views of the reserved storage is checked bit-exact on the CPU only; elsewhere
        # (CUDA picks attention kernels by strides too) it is given contiguous copies
        self._views = device.type == "cpu"
        self._key_store: torch.Tensor | None = None
        self._value_store: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        if self._room is None:
            return
        capacity = self._room.shape[0]
        self._key_store = key_states.new_empty((*key_states.shape[:2], capacity, key_states.shape[3]))
        self._value_store = value_states.new_empty((*value_states.shape[:2], capacity, value_states.shape[3]))
        self.keys, self.values = self._key_store[:, :, :0], self._value_store[:, :, :0]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._key_store, self._value_store
        if keys is None or values is None:
            return super().update(key_states, value_states, *args, **kwargs)
        assert self.keys is not None
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > keys.shape[2] or key_states.shape[:2] != keys.shape[:2] or key_states.dtype != keys.dtype:
            self._give_up_reservation()  # longer than reserved (a cache reused after generate): as Transformers
            return super().update(key_states, value_states, *args, **kwargs)
        keys[:, :, start:end].copy_(key_states)
        values[:, :, start:end].copy_(value_states)
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        if self._views:
            return self.keys, self.values
        # contiguous copies, laid out as concatenation lays them out, live while the layer's attention runs
        return self.keys.contiguous(), self.values.contiguous()

    def _give_up_reservation(self) -> None:
        """Become a plain ``DynamicLayer``: the filled part copied out, the reserved storage let go."""
        if self._key_store is not None and self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys.clone(), self.values.clone()
        self._room = self._key_store = self._value_store = None

    def reset(self) -> None:
        self._give_up_reservation()
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        self._give_up_reservation()
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._give_up_reservation()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._give_up_reservation()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._give_up_reservation()
        super().batch_select_indices(indices)


def reserves(model: Any, kwargs: dict[str, Any], settings: Any) -> bool:
    """Whether ``model.generate(**kwargs)``, run with the generation config ``settings``, will reserve its
    cache (``reserve_default_cache`` installed, a default ``DynamicCache`` of full-attention layers
    only), so that a decode step holds it once."""
    prepare = getattr(model, "_prepare_cache_for_generation", None)
    supports = getattr(model, "_supports_default_dynamic_cache", lambda: False)
    return (
        getattr(prepare, "reserves", False)
        and all(kwargs.get(name) is None for name in _CACHE_KWARGS)
        and kwargs.get("assistant_model") is None
        and getattr(settings, "cache_implementation", None) in (None, "dynamic")
        and bool(getattr(settings, "use_cache", True))
        and (getattr(settings, "num_beams", 1) or 1) == 1  # beam search gives the reservation up
        and supports()
        and full_attention_only(getattr(model, "config", None))
    )


def full_attention_only(config: Any) -> bool:
    """Whether every layer of ``config``'s decoder caches every position (no sliding windows or other kinds)."""
    long = 1 << 30
    positions = None if config is None else cache_positions(config, long)
    return positions is not None and bool(positions) and all(p == long for p in positions)


def reservable(cache: Any) -> bool:
    """Whether ``cache`` is a fresh ``DynamicCache`` of plain full-attention layers (``generate``'s default
    for most decoders), whose layers can be reserved."""
    layers = getattr(cache, "layers", None) or []
    return (
        type(cache) is DynamicCache
        and bool(layers)
        and all(type(layer) is DynamicLayer and not layer.is_initialized for layer in layers)
    )


def reserve_default_cache(prepare: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``model._prepare_cache_for_generation`` that reserves the default cache it makes for
    ``max_cache_length`` positions on ``device`` (where ``reservable``)."""
    signature = inspect.signature(prepare)

    @functools.wraps(prepare)
    def run(generation_config: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        passed = any(model_kwargs.get(name) is not None for name in _CACHE_KWARGS)
        result = prepare(generation_config, model_kwargs, *args, **kwargs)
        try:
            bound = signature.bind_partial(generation_config, model_kwargs, *args, **kwargs)
        except TypeError:  # a model's own signature: leave its cache as it is
            return result
        capacity = bound.arguments.get("max_cache_length")
        name = next((n for n in _CACHE_KWARGS if model_kwargs.get(n) is not None), None)
        assistant = getattr(generation_config, "is_assistant", False)
        if not passed and not assistant and name and isinstance(capacity, int) and capacity > 1:
            cache = model_kwargs[name]
            if reservable(cache):
                cache.layers = [ReservedLayer(capacity, device) for _ in cache.layers]
        return result

    run.reserves = True  # type: ignore[attr-defined]  # what ``reserves`` looks for
    return run
