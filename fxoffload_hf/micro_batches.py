"""``generate`` on a batch whose KV cache cannot fit the budget beside the largest piece: the batch is split
into micro-batches that run as one block (``cohort``), FlexGen's block schedule behind the ordinary call.

A decode step holds the cache it is passed and the one it builds. Whole, that is twice the batch's cache;
in micro-batches, the ones waiting hold their caches while the ones that fit run, so the step needs the
batch's cache once plus what the running ones build. Each weight still streams once per run for every
micro-batch in it. Each micro-batch's tokens are exactly eager's for that micro-batch; the whole batch's
can differ from them at near-ties (its matrix products have other sizes and may round differently), which
is why this happens only where the call would otherwise be refused, with a warning.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fxoffload_hf.engine import Engine
from fxoffload_hf.memory_model import BudgetTooSmallError, format_bytes
from fxoffload_hf.progress import report


def split_generate(
    engine: Engine,
    generate: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    settings: Any,
    batch: int,
    cache: int,
    step: int,
    built: int,
) -> Any | None:
    """``generate(*args, **kwargs)`` (``batch`` prompts, run with the generation config ``settings``) in
    micro-batches, or None where it cannot be split (the caller then refuses it as before). ``cache``: the
    batch's KV cache at its last token; ``step``: what a decode step of the whole batch holds beside its
    caches; ``built``: the cache a decode step of the whole batch builds anew (``cache``, or 0 where it
    is written in place). Not split: a batch of one, a cache that cannot fit even in micro-batches of one, or outputs
    this cannot merge (``return_dict_in_generate``, a streamer). Where capture refuses the micro-batches
    chosen, smaller ones are tried, down to one sequence each."""
    if batch < 2 or kwargs.get("streamer") is not None or settings.return_dict_in_generate:
        return None
    need = functools.partial(_step_need, batch, cache=cache, step=step, built=built)
    size = _largest_that_fits(engine, batch, need)
    if size is None:
        return None
    warnings.warn(
        f"generate: the KV cache of {batch} sequences ({format_bytes(cache)} at the last token) cannot fit the "
        f"budget whole; running the batch as {-(-batch // size)} micro-batches of up to {size} in one block. "
        "Each micro-batch's tokens are eager's for that micro-batch; the whole batch's may differ at near-ties",
        stacklevel=4,
    )
    while True:
        try:
            outputs = _in_micro_batches(engine, generate, args, kwargs, batch, size, need(size))
            break
        except BudgetTooSmallError:
            # the size was chosen before capture, from the weights' smallest units; capture knows which
            # weights cannot be tiled: smaller micro-batches, down to one sequence each
            if size == 1:
                raise
            size = -(-size // 2)
            report("generate: micro-batches do not fit; trying micro-batches of %d", size)
    pad = settings.pad_token_id if settings.pad_token_id is not None else settings.eos_token_id
    pad = pad[0] if isinstance(pad, list | tuple) else pad
    return _stacked(outputs, pad)


def _step_need(batch: int, size: int, *, cache: int, step: int, built: int) -> int:
    """What a decode step in micro-batches of ``size`` holds: the caches of all (``cache``, the whole
    batch's) and what the running ones build and hold (``built + step`` for the whole batch)."""
    return cache + -(-(built + step) * size // batch)


def _largest_that_fits(engine: Engine, batch: int, need: Callable[[int], int]) -> int | None:
    """The largest micro-batch size, the batch halved (rounded up) until its ``need`` fits, or None if one
    sequence at a time cannot."""
    size = batch
    while size > 1:
        size = -(-size // 2)
        if engine.fits_activations(need(size)):
            return size
    return None


def _in_micro_batches(
    engine: Engine,
    generate: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: int,
    size: int,
    need: int,
) -> list[Any]:
    """The call's batch in micro-batches of ``size`` as one block, whose decode steps hold ``need``."""
    what = f"generate's KV caches reach {format_bytes(need)} at the last token of a micro-batch of {size}"
    engine.expect_activations(need, what, instead=True)
    parts = [slice(start, start + size) for start in range(0, batch, size)]
    calls = [functools.partial(_sliced_call, generate, args, kwargs, batch, part) for part in parts]
    return engine.run_together(calls)[0]


def _sliced_call(
    generate: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], batch: int, part: slice
) -> Any:
    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return value[part]
        return value

    return generate(*[cut(a) for a in args], **{k: cut(v) for k, v in kwargs.items()})


def _stacked(outputs: list[Any], pad: int | None) -> torch.Tensor:
    """The micro-batches' sequences as one batch: those that stopped early padded as generate pads a
    finished sequence of a batch."""
    width = max(o.shape[1] for o in outputs)
    if pad is None and any(o.shape[1] != width for o in outputs):
        raise ValueError(
            "generate in micro-batches: some stopped earlier than others, and the model has neither a "
            "pad_token_id nor an eos_token_id to pad them with; pass pad_token_id="
        )
    return torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1]), value=pad or 0) for o in outputs])
