"""Capture: ghost parameters in the module, and the ``torch.compile`` backend that receives its graphs.

A ghost stands in for an offloaded parameter: same shape, dtype and device, but a zero-stride view of
one NaN, so whole-module ``.to()`` calls cost nothing and any computation that reads it outside a
captured graph and outside its module's call gives NaN rather than a plausible number. A module that
runs eagerly gets its ghosts' values for the call (``eager_fallback``). Inside a captured graph the
ghost is a placeholder whose handle tells the engine which stored weight to feed in its place.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.experimental._config as shape_config
from torch import nn

from fxoffload_hf import blocks, dynamo_package
from fxoffload_hf.blocks import BlockRegions
from fxoffload_hf.compile_cache import EntryCache
from fxoffload_hf.weight_record import WeightRecord
from fxoffload_hf.weights import WeightStore

HANDLE_ATTR = "_fxoffload_handle"
_SUCCESSOR_ATTR = "_fxoffload_successor"
# Graphs one entry point may capture: lengths never add graphs (sizes are symbolic), but dynamo
# specialises on what is None, on sizes of 1 and on cache state, and Transformers' generate and
# pipelines combine those (mask, position ids, batch, prefill or decode) into up to 16 forms.
RECOMPILE_LIMIT = 32


@dataclass(frozen=True)
class GhostHandle:
    """Attached to a ghost: the store and the record of the weight it stands for."""

    store: WeightStore
    record: WeightRecord


def make_ghost(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A parameter of ``shape`` that holds one NaN element broadcast to the full shape."""
    seed = torch.full((1,), float("nan"), dtype=dtype, device=device)
    return nn.Parameter(seed.expand(shape), requires_grad=False)


def ghost_for(store: WeightStore, record: WeightRecord, device: torch.device) -> nn.Parameter:
    """A ghost standing for ``record`` of ``store``."""
    ghost = make_ghost(record.shape, record.dtype, device)
    setattr(ghost, HANDLE_ATTR, GhostHandle(store, record))
    return ghost


def convert_ghosts(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Apply a ``.to()``-style ``fn`` to the ghosts of ``module`` without materializing them.

    A dtype change re-types the stored weight (converted as it streams); a device change is refused,
    since the engine's device is fixed when the model is offloaded.
    """
    for attr, ghost in list(module._parameters.items()):
        handle = handle_of(ghost)
        if ghost is None or handle is None:
            continue
        probe = fn(torch.zeros((), dtype=ghost.dtype, device=ghost.device))
        if probe.device != ghost.device:
            raise ValueError(
                f"{type(module).__name__}.{attr} is offloaded by fxoffload_hf to compute on {ghost.device}; "
                f"to use {probe.device}, call fxoffload_hf.restore(model) and offload it again with that device"
            )
        if probe.dtype == ghost.dtype:
            continue
        successor = getattr(ghost, _SUCCESSOR_ATTR, None)
        if successor is None or successor.dtype != probe.dtype:
            handle.store.set_dtype(handle.record.name, probe.dtype)
            successor = make_ghost(ghost.shape, probe.dtype, ghost.device)
            setattr(successor, HANDLE_ATTR, handle)
            setattr(ghost, _SUCCESSOR_ATTR, successor)  # tied uses elsewhere pick up the same ghost
        module._parameters[attr] = successor


def guarded_apply(module: nn.Module) -> Callable[..., nn.Module]:
    """An ``_apply`` for a module holding ghosts: its other tensors as usual, its ghosts as above."""
    original = module._apply

    def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        ghosts = {k: p for k, p in module._parameters.items() if handle_of(p) is not None}
        for key in ghosts:
            module._parameters[key] = None  # _apply skips None parameters
        try:
            original(fn, recurse)
        finally:
            for key, ghost in ghosts.items():
                module._parameters[key] = ghost
        convert_ghosts(module, fn)
        return module

    return _apply


def refuse_state_dict_load(module: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``load_state_dict`` pre-hook: weights of an offloaded model come from its store, not from here."""
    raise RuntimeError(
        "load_state_dict into a model offloaded by fxoffload_hf is not supported: load the weights first and "
        "offload afterwards, or call fxoffload_hf.restore(model) before loading"
    )


def handle_of(value: Any) -> GhostHandle | None:
    return getattr(value, HANDLE_ATTR, None)


def compile_entry(
    fn: Callable[..., Any],
    backend: Callable[..., Any],
    regions: BlockRegions | None = None,
    dynamic: bool = True,
    cache: EntryCache | None = None,
) -> Callable[..., Any]:
    """``torch.compile`` ``fn`` with our backend, called in one canonical form.

    Sizes are symbolic from the first call (parameters stay static), so new sequence, cache or batch
    lengths reuse the graphs already captured instead of recompiling one by one. A size of 1 is still
    specialised by dynamo: one sequence and a batch of them, a prompt and a decode step of one token,
    are captured apart, as are calls with and without a mask or position ids: a few of each combination,
    hence a recompile limit above dynamo's default of 8. Data-dependent ops (``.item()`` in mixture-of-experts
    routing) still break the graph: capturing them (``capture_scalar_outputs``) makes LED fail in
    dynamo (a pending unbacked symbol). ``regions`` (the model's repeated blocks) are given up, and the
    call captured again without them, when dynamo cannot capture one. ``dynamic=False`` (a plan of one
    call's sizes) keeps every size static: no symbols to reason about, about half dynamo's tracing.
    ``cache``: the entry's compile cache (``compile_cache``), installed now and captured into.
    """
    if cache is None:
        compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=False)
    else:
        # torch.compile's own path, with a package of the frame to save (``compile_cache``)
        package = cache.package_for(fn)
        compiled = torch._dynamo.optimize(cache.backend(backend), dynamic=dynamic, package=package)(fn)
    canonical = canonical_call(fn)
    saving = dynamo_package.saving_guards if cache is not None else nullcontext

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = canonical(args, kwargs)
        with capture_settings(), saving():
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.UncapturedHigherOrderOpError:
                # raised while a frame compiles, before it runs; frames of this call that ran before it
                # hold no block regions' work, and are guarded to run the same way again
                if regions is None or not regions.give_up():
                    raise
                return compiled(*args, **kwargs)

    return run


@contextmanager
def capture_settings() -> Iterator[None]:
    """Dynamo's settings while fxoffload captures (see the notes inside)."""
    dynamo_settings: dict[str, Any] = {
        "recompile_limit": RECOMPILE_LIMIT,
        # float attributes of modules (norm epsilons, attention scales) stay constants of the graph: as
        # symbols they add a placeholder and a guard each and never change between calls
        "specialize_float": True,
    }
    if blocks.SUPPORTED:
        # repeated blocks are traced once as nested regions (``blocks``), then inlined: the engine
        # partitions a flat graph
        dynamo_settings["inline_invoke_subgraph"] = True
    with (
        # sizes that happen to be equal are not given one symbol (duck sizing): a cache of 64 positions
        # and a head dimension of 64 would be, and the first decode step after a 64-token prompt would
        # be captured for that length alone
        shape_config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
        torch._dynamo.config.patch(dynamo_settings),
    ):
        yield


def canonical_call(
    fn: Callable[..., Any],
) -> Callable[[tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]:
    """A function that writes any call of ``fn`` one way: every argument that has a name by its name
    (only positional-only and ``*args`` ones by position). Positional and keyword forms of one call then
    share a graph, even when a decorator (``*args, **kwargs``) stands between the caller and the real
    signature; decorators that look arguments up by name (Transformers fills ``use_cache`` from the
    config when it is not passed by name) see them as the caller meant. Defaults are not filled in: a
    decorator may tell an argument left out from one passed as its default."""
    try:
        signature = inspect.signature(fn)  # follows __wrapped__ to the decorated forward
    except (TypeError, ValueError):
        return lambda args, kwargs: (args, kwargs)

    def canonical(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return args, kwargs  # let the call itself raise its own error
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = signature.parameters[name].kind
            if kind is inspect.Parameter.POSITIONAL_ONLY:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            else:
                named[name] = value
        return tuple(positional), named

    return canonical


def graph_check(fn: Callable[..., Any]) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """A function telling whether dynamo holds a graph of ``fn`` (compiled by ``compile_entry``) whose
    guards pass for a call: asked of its cache entries as dynamo asks them, so False means the call would
    be captured anew. Ask it in the state the call runs in (``eager_paths.inside``: graphs are guarded
    on it). A frame past a graph break is not asked: a call that passes and breaks into a new frame still
    captures that one. Always False where the function's frame cannot be told (no code to read)."""
    function = getattr(fn, "__func__", fn)
    code = getattr(function, "__code__", None)
    if code is None:
        return lambda args, kwargs: False
    canonical = canonical_call(fn)
    signature = inspect.signature(function, follow_wrapped=False)  # the frame's own arguments
    owner = (fn.__self__,) if inspect.ismethod(fn) else ()
    free: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, function.__closure__ or (), strict=True):
        with suppress(ValueError):  # a cell not filled yet
            free[name] = cell.cell_contents

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        entries: list[Any] = [
            *torch._dynamo.eval_frame._debug_get_cache_entry_list(code),
            *torch._C._dynamo.eval_frame._debug_get_precompile_entries(code),  # installed from the cache
        ]
        if not entries:
            return False
        args, kwargs = canonical(args, kwargs)
        try:
            bound = signature.bind(*owner, *args, **kwargs)
        except TypeError:
            return False
        bound.apply_defaults()
        frame_locals = {**free, **bound.arguments}
        try:
            return any(entry.guard_manager.check(frame_locals) for entry in entries)
        except Exception:  # noqa: BLE001 - a guard that cannot read these locals: dynamo would capture
            return False

    return check
