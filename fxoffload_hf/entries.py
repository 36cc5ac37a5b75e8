"""Entry points of an offloaded model: the methods routed through the engine (compiled with it as the
backend, or run eagerly before capture under ``capture="deferred"``), and ``generate`` with its KV cache
counted before the first token (``generate_memory``)."""

from __future__ import annotations

import functools
import gc
import time
from typing import Any

import torch
from torch import nn

from fxoffload_hf import compile_cache, eager_paths
from fxoffload_hf.capture import compile_entry, graph_check
from fxoffload_hf.eager_fallback import EagerWeights
from fxoffload_hf.eager_forwards import unwrapped_forward
from fxoffload_hf.eager_memory import eager_call_bytes
from fxoffload_hf.eager_ops import OpCounter
from fxoffload_hf.engine import Engine
from fxoffload_hf.generate_memory import counting_kv
from fxoffload_hf.memory_model import BudgetTooSmallError, CallStoppedMidway
from fxoffload_hf.output_check import warn_on_nan
from fxoffload_hf.reserved_cache import reserve_default_cache
from fxoffload_hf.undo import PatchedAttribute, Undo


def wrap(
    model: nn.Module, names: tuple[str, ...], engine: Engine, eager: EagerWeights, undo: list[Undo]
) -> None:
    """Route each of ``model``'s methods ``names`` (dotted: ``model.encoder.forward``) through ``engine``,
    count ``generate``'s KV cache before its first token, and reserve its default cache for its final
    length (``reserved_cache``); each change recorded in ``undo``."""
    for name in names:
        _wrap_entry(model, name, engine, eager, undo)
    generate = getattr(model, "generate", None)
    if callable(generate):
        had_own = "generate" in model.__dict__
        undo.append(PatchedAttribute(model, "generate", had_own, model.__dict__.get("generate")))
        setattr(model, "generate", counting_kv(model, generate, engine))  # noqa: B010
    prepare = getattr(model, "_prepare_cache_for_generation", None)
    if callable(prepare):
        had_own = "_prepare_cache_for_generation" in model.__dict__
        undo.append(
            PatchedAttribute(
                model,
                "_prepare_cache_for_generation",
                had_own,
                model.__dict__.get("_prepare_cache_for_generation"),
            )
        )
        setattr(model, "_prepare_cache_for_generation", reserve_default_cache(prepare, engine.device))  # noqa: B010


def entry_target(model: nn.Module, entry: str) -> nn.Module:
    """The module whose method ``entry`` names (``model.encoder.forward``: the encoder)."""
    target = model
    for part in entry.split(".")[:-1]:
        target = getattr(target, part)
    return target


def _wrap_entry(model: nn.Module, entry: str, engine: Engine, eager: EagerWeights, undo: list[Undo]) -> None:
    """Route ``model.<entry>`` through the engine (compiled with it as the backend)."""
    target = entry_target(model, entry)
    attr = entry.split(".")[-1]
    # a module holding weights itself has its forward wrapped by the eager fallback (never compiled)
    original = unwrapped_forward(getattr(target, attr))
    # made at the first call that captures (``torch.compile`` itself takes a fifth of a second, which a
    # deferred model's short job need not pay)
    cache = _entry_cache(model, entry, engine)
    compiled = functools.cache(lambda: compile_entry(original, engine, cache=cache))
    served = graph_check(original)  # whether a captured graph serves a call

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            # traced as part of another entry point (an encoder inside the full forward): inline it
            return original(*args, **kwargs)
        with engine.lock, eager_paths.inside(masks_by_value=engine.device.type == "cuda"):
            lent = eager.mark()
            graphs = len(engine.runners)
            inputs: _InputVersions | None = None
            ran_before = (engine.stats.runs, engine.stats.pieces_run)
            capturing = False

            def runs_again() -> bool:
                # graphs of this call may have run before a later one was refused (graph breaks): a call
                # whose inputs they could not change (no cache passed in, no tensor written to) may be
                # run again whole as eager code; what they did to a cache cannot be undone
                ran = (engine.stats.runs, engine.stats.pieces_run) != ran_before
                return not ran or (inputs is not None and inputs.unchanged())

            try:
                deferral = engine.deferral
                if engine.eager_depth:
                    return _run_eagerly(engine, eager, target, original, args, kwargs)
                engine.captures.progress.starts()
                # after deferring ended, only a call no graph serves may run eagerly, outside a block (whose
                # calls are captured so that each weight is read once for all): the calls graphs serve
                # (every decode step) are not bounded at all
                uncaptured = (
                    not deferral.on
                    and ((deferral.deferred_capture and graphs) or deferral.new_graphs_refused)
                    and engine.cohort is None
                    and (  # a call's kind is read only once a kind was refused (it walks every argument)
                        (deferral.refused_kinds and call_kind(args, kwargs) in deferral.refused_kinds)
                        or not served(args, kwargs)
                    )
                )
                if deferral.on or uncaptured:
                    need = eager_call_bytes(target, args, kwargs)
                    expected = engine.expected_activations
                    if deferral.runs_eagerly(need, expected) or (
                        uncaptured and deferral.runs_uncaptured(need, expected)
                    ):
                        return _run_eagerly(engine, eager, target, original, args, kwargs)
                engine.call_started = time.perf_counter()
                if deferral.by_choice or engine.cohort is None:
                    # read only where a refused capture may run the call again as eager code
                    inputs = _InputVersions.of(args, kwargs)
                capturing = True
                with compile_cache.running(engine):
                    return compiled()(*args, **kwargs)
            except BaseException as exc:
                eager.unwind(lent)  # an interrupt skips the modules' post-hooks
                inner = getattr(exc, "inner_exception", None)
                # a budget refused while a graph is captured comes wrapped by dynamo: raised as itself
                refused = inner if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed) else exc
                if capturing and engine.deferral.by_choice and isinstance(refused, BudgetTooSmallError):
                    engine.deferral.stay_eager(refused)  # captured for speed, which this budget cannot give
                    if runs_again():
                        return _run_eagerly(engine, eager, target, original, args, kwargs)
                    raise CallStoppedMidway(
                        f"{refused}. This call was being captured for speed and part of it had run when a "
                        "later graph of it was refused; it cannot be run again from where it stopped. Calls "
                        "run as eager code from now on: call it again (a generate that makes its own cache "
                        "starts again by itself)",
                        smallest_budget=refused.smallest_budget,
                    ) from None
                if (
                    capturing
                    and isinstance(refused, BudgetTooSmallError)
                    and engine.cohort is None
                    and runs_again()
                ):
                    # a kind of call whose capture the budget refuses (beside the graphs held, if any): as
                    # eager code where its bound fits, and later ones too, as a call no graph serves in
                    # the default mode is (a generate's step with its KV cache expected: where that does
                    # not fit, the generate runs in micro-batches, or its cache on disk)
                    engine.deferral.refused_new_graph(refused, call_kind(args, kwargs))
                    need = eager_call_bytes(target, args, kwargs)
                    if engine.deferral.runs_uncaptured(need, engine.expected_activations):
                        return _run_eagerly(engine, eager, target, original, args, kwargs)
                if capturing and isinstance(refused, BudgetTooSmallError):
                    smaller = engine.deferral.or_eagerly(refused)  # eager calls may need less
                    if smaller is not refused:
                        raise smaller from None
                if refused is not exc and isinstance(refused, (ValueError, NotImplementedError)):
                    raise refused from None
                raise
            finally:
                if len(engine.runners) != graphs:
                    # capture leaves the call's tensors (a KV cache of hundreds of MiB) in reference
                    # cycles of dynamo's state: free them now, not at Python's next collection
                    gc.collect()
                if cache is not None:
                    cache.save()

    undo.append(PatchedAttribute(target, attr, attr in target.__dict__, target.__dict__.get(attr)))
    setattr(target, attr, run)


def call_kind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
    """What tells a kind of call from another beside its sizes: each argument's name, a tensor's rank and
    dtype, a plain value itself, another object's type (a cache's)."""

    def of(value: Any) -> object:
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dim(), value.dtype)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(of(v) for v in value))
        if isinstance(value, (bool, int, float, str, type(None))):
            return value
        return type(value).__qualname__

    return tuple(of(a) for a in args), tuple(sorted((k, of(v)) for k, v in kwargs.items()))


class _InputVersions:
    """A call's arguments as they were before it: the tensors among them, each with its version (a write
    in place bumps it), where every argument is a tensor, a plain value or a container of those; None
    (``unchanged`` is then False) where one is an object the call may change (a cache)."""

    _PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)

    def __init__(self, tensors: list[tuple[torch.Tensor, int]] | None) -> None:
        self.tensors = tensors

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _InputVersions:
        tensors: list[tuple[torch.Tensor, int]] = []
        pending: list[Any] = [*args, *kwargs.values()]
        while pending:
            value = pending.pop()
            if isinstance(value, torch.Tensor):
                if value.is_inference():  # made under ``torch.inference_mode``: keeps no version
                    return cls(None)
                tensors.append((value, value._version))
            elif isinstance(value, (list, tuple)):
                pending.extend(value)
            elif type(value) is dict:  # a plain dict (not a ``ModelOutput`` or another object of state)
                pending.extend(value.values())
            elif not isinstance(value, cls._PLAIN):
                return cls(None)
        return cls(tensors)

    def unchanged(self) -> bool:
        """Whether the call surely left its arguments as they were: none is an object of state, and no
        tensor among them was written in place."""
        return self.tensors is not None and all(t._version == v for t, v in self.tensors)


def _entry_cache(model: nn.Module, entry: str, engine: Engine) -> compile_cache.EntryCache | None:
    """The compile cache of ``model``'s ``entry``, where the cache is on."""
    folder = engine.config.compile_cache
    if folder is None:
        return None
    key = functools.partial(compile_cache.entry_key, model, entry, engine.config)
    return compile_cache.EntryCache(folder, key, f"{type(model).__name__}.{entry}")


def _run_eagerly(
    engine: Engine,
    eager: EagerWeights,
    target: nn.Module,
    original: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """One call of an entry point as eager code, before capture (``capture="deferred"``): the eager
    fallback hooks lend each module its weights, without their warning (this is on purpose), the entry
    point's own module here (its hooks would lend around captured calls too). An entry point called inside
    it (an encoder inside the full forward) is part of the same call."""
    if engine.eager_depth:
        with eager.lending_to(target):
            return original(*args, **kwargs)
    lent_before, warned = eager.lends, eager.warn
    start = time.perf_counter()
    eager.warn = False
    eager.ahead.room = engine.deferral.in_flight_room
    engine.eager_depth += 1
    # the size of the graph a capture of this call would hold, where the budget counts it (``eager_ops``;
    # some calls: ``Deferral.counts_this_call``)
    counter = OpCounter(active=engine.deferral.counts_this_call())
    try:
        with counter, eager.lending_to(target):
            output = original(*args, **kwargs)
        warn_on_nan(output, engine.stats.eager_calls, type(target).__name__)
        return output
    finally:
        engine.eager_depth -= 1
        eager.ahead.stop()
        eager.warn = warned
        engine.deferral.ran_eagerly(time.perf_counter() - start, eager.lends - lent_before, counter.ops)
