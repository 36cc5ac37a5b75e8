"""``generate``'s KV cache at its final length, counted before the first token: a call whose cache cannot
fit the budget is refused before any weight is read, not at the decode step that outgrows it.

The cache is predicted from the config (``kv_cache.predicted_cache_bytes``: each layer's keys and values
at full attention or over its sliding window, as Transformers reads the layer types, or latent
attention's latents) for the batch and the final length the call asks for. Only where that is what the
cache holds: a decoder whose ``forward`` takes a cache and whose layers are all of those kinds (no
state-space layers, no shared caches). Elsewhere nothing is predicted, and the engine measures each
call as before (``activations``). A decode step of latent attention also holds one layer's latents
expanded to every head (``kv_cache.latent_expansion_bytes``).
"""

from __future__ import annotations

import copy
import functools
import gc
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxoffload_hf.engine import Engine
from fxoffload_hf.kv_cache import cache_positions, latent_expansion_bytes, predicted_cache_bytes, text_config
from fxoffload_hf.kv_disk import cache_folder
from fxoffload_hf.memory_model import BudgetTooSmallError, CallStoppedMidway, format_bytes
from fxoffload_hf.micro_batches import split_generate
from fxoffload_hf.progress import report
from fxoffload_hf.reserved_cache import on_disk, reserves

_CACHE_ARGUMENTS = {"cache", "past_key_values", "state"}  # Transformers 5.25's name, earlier ones', RWKV's


def predictable_cache(model: nn.Module) -> bool:
    """Whether the bytes of ``model``'s generate cache follow from its config (``kv_cache``)."""
    return _decoder_with_cache(model) and predicted_cache_bytes(model.config, 1, 1, 4) is not None


def _decoder_with_cache(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder with a config whose ``forward`` takes a cache."""
    forward = getattr(model, "forward", None)
    if forward is None or not _CACHE_ARGUMENTS & set(inspect.signature(forward).parameters):
        return False
    config = getattr(model, "config", None)
    return config is not None and not getattr(config, "is_encoder_decoder", False)


@dataclass(frozen=True)
class GenerateCall:
    """What a ``generate`` call's memory depends on, read once from its arguments."""

    batch: int  # prompts
    sequences: int  # prompts x beams (or returned sequences)
    positions: int  # in the cache at the last token
    itemsize: int  # of the weights (and so of the cache)
    settings: Any  # the generation config the call runs with


def read_call(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> GenerateCall | None:
    """The call's shape, where the cache is predicted: a decoder with a cache, given token ids; else None."""
    if not _decoder_with_cache(model):
        return None
    ids = kwargs.get("input_ids", args[0] if args else kwargs.get("inputs"))
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None  # embeddings, or another modality's inputs: the length is not the prompt's
    settings = _generation_settings(model, kwargs)
    if settings is None:
        return None
    batch, length = ids.shape
    new = settings.max_new_tokens if settings.max_new_tokens is not None else settings.max_length - length
    sequences = batch * max(settings.num_beams or 1, settings.num_return_sequences or 1)
    itemsize = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    # the last new token is returned, never fed back: the cache holds one position fewer than the output
    return GenerateCall(batch, sequences, length + max(new, 1) - 1, itemsize, settings)


def final_kv_bytes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the KV cache at the end of ``model.generate(*args, **kwargs)``; 0 where not predicted
    (``kv_cache.predicted_cache_bytes`` reads the layer kinds)."""
    call = read_call(model, args, kwargs)
    return 0 if call is None else _cache_bytes(model, call)


def decode_step_bytes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes a decode step of ``generate`` holds beside its KV caches, at most: the logits of each
    sequence, and a few hidden and MLP states of its one position (0 where the cache is not predicted)."""
    call = read_call(model, args, kwargs)
    return 0 if call is None else _step_bytes(model, call)


def _cache_bytes(model: nn.Module, call: GenerateCall) -> int:
    return predicted_cache_bytes(model.config, call.sequences, call.positions, call.itemsize) or 0


def _step_bytes(model: nn.Module, call: GenerateCall) -> int:
    text = text_config(model.config)
    hidden = getattr(text, "hidden_size", 0) or 0
    per_row = (getattr(text, "vocab_size", 0) or 0) + 3 * (
        getattr(text, "intermediate_size", 0) or 4 * hidden
    )
    # latent attention expands a layer's cached latents to every head's keys and values at each step
    expansion = latent_expansion_bytes(model.config, call.sequences, call.positions, call.itemsize)
    return call.sequences * (per_row + 8 * hidden) * call.itemsize + expansion


def _generation_settings(model: nn.Module, kwargs: dict[str, Any]) -> Any:
    """The generation config a ``generate(**kwargs)`` call runs with (the model's, updated by the call's
    keywords), or None."""
    settings = copy.deepcopy(kwargs.get("generation_config") or getattr(model, "generation_config", None))
    if settings is not None:
        settings.update(**{k: v for k, v in kwargs.items() if hasattr(settings, k)})
    return settings


def counting_kv(model: nn.Module, generate: Callable[..., Any], engine: Engine) -> Callable[..., Any]:
    """``generate`` that first tells the engine the bytes its KV cache will reach (when predicted); a batch
    whose cache cannot fit whole runs in micro-batches where they fit (``micro_batches``), and one refused
    during its run for its activations is run again so; where neither fits, the cache is kept on disk
    (CPU runs whose default cache is reserved: ``reserved_cache.on_disk``)."""

    @functools.wraps(generate)
    def run(*args: Any, **kwargs: Any) -> Any:
        # a generate captures two graphs: the prefill's and, with the first longer input, the decode's
        try:
            with engine.expecting_graphs(2):
                return counted(*args, **kwargs)
        except CallStoppedMidway as stopped:
            # its cache was extended by the graphs that ran: a generate that made its own cache starts
            # again from its first token, now as eager calls; one given a cache or a streamer cannot
            if not _repeatable(generate, args, kwargs):
                raise
            report("generate starts again from its first token, as eager calls: %s", _without_frames(stopped))
        gc.collect()
        with engine.expecting_graphs(2):
            return counted(*args, **kwargs)

    def counted(*args: Any, **kwargs: Any) -> Any:
        call = read_call(model, args, kwargs)
        cache = 0 if call is None else _cache_bytes(model, call)
        if call is None or not cache:
            return generate(*args, **kwargs)
        step = _step_bytes(model, call)
        # the last decode step holds the cache it is passed, the one it builds (none where the cache is
        # written in place: ``reserved_cache``) and its own states
        built = 0 if reserves(model, kwargs, call.settings) else cache
        what = f"generate's KV cache reaches {format_bytes(cache)} at its last token" + (
            ", held twice by a decode step" if built else ""
        )
        try:
            engine.expect_activations(cache + built + step, what)
            return generate(*args, **kwargs)
        except CallStoppedMidway:
            raise  # not for want of room: run again whole (``run``)
        except BudgetTooSmallError as exc:
            # refused before the first token, or (where the prediction was short of a capture's
            # measure) at a later step: the call is given up, and with it the frames of its steps (their
            # caches and states), which the refusal's traceback would keep through the call run again
            refusal = _without_frames(exc)
        gc.collect()
        # the whole call again in micro-batches, where they fit
        split = None
        if engine.cohort is None:
            split = split_generate(
                engine, generate, args, kwargs, call.settings, call.batch, cache, step, built
            )
        if split is not None:
            return split
        if not reserves(model, kwargs, call.settings) or engine.device.type != "cpu":
            raise refusal
        return _with_cache_on_disk(model, generate, engine, args, kwargs, cache, step)

    return run


def _repeatable(generate: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``generate(*args, **kwargs)`` can be run again from its start: not one given a cache (run
    again, it would extend it twice) or a streamer (its first tokens streamed twice), by name or place."""
    try:
        given = inspect.signature(generate).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return False
    given = {**given, **given.get("kwargs", {})}  # generate's own ``**kwargs``, passed to the model
    return all(given.get(name) is None for name in _CACHE_ARGUMENTS | {"cache_params", "streamer"})


def _without_frames(error: BaseException) -> BaseException:
    """``error`` with no traceback nor chained errors: nothing of the call that raised it is kept."""
    error.__traceback__, error.__context__, error.__cause__ = None, None, None
    return error


def _with_cache_on_disk(
    model: nn.Module,
    generate: Callable[..., Any],
    engine: Engine,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    cache: int,
    step: int,
) -> Any:
    """Run ``generate`` with its KV cache (``cache`` bytes at the end) in files (``kv_disk``): about two
    layers of it in memory at a time, beside the step's own ``step`` bytes; refused where even that
    cannot fit."""
    layers = len(cache_positions(model.config, 1) or ()) or 1
    in_memory = 2 * -(-cache // layers)  # two layers' keys and values
    folder = cache_folder(engine.config.offload_folder)
    engine.expect_activations(
        in_memory + step,
        f"generate's KV cache reaches {format_bytes(cache)} at its last token; kept on disk it still "
        f"holds {format_bytes(in_memory)} (two layers) in memory",
        instead=True,
    )
    warnings.warn(
        f"generate's KV cache reaches {format_bytes(cache)}, more than the budget leaves; it is kept in "
        f"files in {folder}, about two layers of it in memory at a time (the same tokens, more reading "
        "per token; a larger budget keeps it in memory)",
        KVCacheOnDiskWarning,
        stacklevel=3,
    )
    if not engine.runners:
        # the call that did not fit was given up: with the cache on disk its eager calls may fit again
        engine.deferral.resume("generate starts again with its KV cache on disk")
    try:
        with on_disk(folder):
            return generate(*args, **kwargs)
    finally:
        gc.collect()  # the cache's layers page each other out, a ring of references: free their files now


class KVCacheOnDiskWarning(UserWarning):
    """A ``generate`` call's KV cache could not fit the budget and is kept on disk instead."""
