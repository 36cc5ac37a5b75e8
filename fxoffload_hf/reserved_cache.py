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

Where the cache cannot fit the budget (``generate_memory``), a call runs ``on_disk(folder)``: each
layer's storage is then a file of its own (``kv_disk.DiskTensor``), and each layer's update pages the
layer before it out (``kv_disk.page_out``; the first layer pages out the last, left from the step
before), after that layer's attention has read it: about two layers are in memory at a time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from fxoffload_hf.kv_cache import cache_positions, text_config
from fxoffload_hf.kv_disk import DiskTensor, page_out, resident_bytes

_CACHE_KWARGS = ("cache", "past_key_values")  # Transformers 5.25's name, and earlier versions'
# the folder the caches reserved in this context go to (``on_disk``); None: RAM
_DISK_FOLDER: contextvars.ContextVar[Path | None] = contextvars.ContextVar("kv_disk_folder", default=None)


@contextlib.contextmanager
def on_disk(folder: Path) -> Iterator[None]:
    """Within it, the caches ``reserve_default_cache`` reserves keep their layers in files in ``folder``."""
    token = _DISK_FOLDER.set(folder)
    try:
        yield
    finally:
        _DISK_FOLDER.reset(token)


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of storage reserved for ``capacity`` positions."""

    def __init__(
        self, capacity: int, device: torch.device, files: tuple[DiskTensor, DiskTensor] | None = None
    ) -> None:
        super().__init__()
        # keys' and values' storage made beforehand in files (``kv_disk``; a graph cannot open files),
        # used where the first update's shapes match them; else RAM
        self._files = files
        self.previous: ReservedLayer | None = None  # the layer this one pages out (on disk)
        self._disk: list[DiskTensor] = []
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
        key_file, value_file = self._files or (None, None)
        self._key_store = self._reserve(key_states, capacity, key_file)
        self._value_store = self._reserve(value_states, capacity, value_file)
        self._files = None
        self.keys, self.values = self._key_store[:, :, :0], self._value_store[:, :, :0]

    def _reserve(self, states: torch.Tensor, capacity: int, file: DiskTensor | None) -> torch.Tensor:
        shape = (*states.shape[:2], capacity, states.shape[3])
        if file is None or file.tensor.shape != shape or file.tensor.dtype != states.dtype:
            return states.new_empty(shape)
        self._disk.append(file)
        return file.tensor

    def stores(self) -> list[torch.Tensor]:
        """The reserved storage of keys and values (empty before the first update or once given up)."""
        return [s for s in (self._key_store, self._value_store) if s is not None]

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
        if self._disk and self.previous is not None:  # its attention ran before this layer's update
            for store in self.previous.stores():
                page_out(store)
        if self._views:
            return self.keys, self.values
        # contiguous copies, laid out as concatenation lays them out, live while the layer's attention runs
        return self.keys.contiguous(), self.values.contiguous()

    def _give_up_reservation(self) -> None:
        """Become a plain ``DynamicLayer``: the filled part copied out, the reserved storage let go."""
        if self._key_store is not None and self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys.clone(), self.values.clone()
        self._room = self._key_store = self._value_store = self._files = None
        self._disk = []

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
                folder = _DISK_FOLDER.get()
                files = _files(
                    prepare, bound.arguments.get("batch_size"), capacity, folder, len(cache.layers)
                )
                layers = [ReservedLayer(capacity, device, f) for f in files]
                if folder is not None:  # a ring, so a cycle: collected after the call (``generate_memory``)
                    for layer, before in zip(layers, layers[-1:] + layers[:-1], strict=True):
                        layer.previous = before
                cache.layers = layers
        return result

    run.reserves = True  # type: ignore[attr-defined]  # what ``reserves`` looks for
    return run


def _files(
    prepare: Callable[..., Any], batch: Any, capacity: int, folder: Path | None, layers: int
) -> list[tuple[DiskTensor, DiskTensor] | None]:
    """Per layer, files for its keys and values where the cache goes to ``folder``: shaped as the model's
    config says a layer's cache is (batch x key-value heads x ``capacity`` x head size), at its dtype."""
    model = getattr(prepare, "__self__", None)
    config = text_config(getattr(model, "config", None)) if model is not None else None
    if folder is None or model is None or config is None or not isinstance(batch, int):
        return [None] * layers
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape, dtype = (batch, heads, capacity, size), model.dtype
    return [(DiskTensor(folder, shape, dtype), DiskTensor(folder, shape, dtype)) for _ in range(layers)]


def disk_resident_bytes(cache: Any) -> int | None:
    """What ``cache`` holds in memory where its layers are on disk (``on_disk``): about two layers; None
    where they are not."""
    layers = [layer for layer in getattr(cache, "layers", None) or [] if isinstance(layer, ReservedLayer)]
    if not any(layer._disk for layer in layers):
        return None
    return resident_bytes([store for layer in layers for store in layer.stores()])
