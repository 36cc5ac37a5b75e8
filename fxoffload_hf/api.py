"""The public API: ``offload(model, ...)`` and ``restore(model)``.

``offload`` is a short list of install steps; each change it makes to the model is written down as a
named undo record as it is made, and ``restore`` (or a failed install) undoes them in reverse.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from fxoffload_hf import align, eager_paths, entries, host_room, tiles, weight_rescaling
from fxoffload_hf.capture import (
    HANDLE_ATTR,
    GhostHandle,
    guarded_apply,
    make_ghost,
    refuse_state_dict_load,
)
from fxoffload_hf.config import BudgetSpec, OffloadConfig
from fxoffload_hf.direct_reads import children_read_directly
from fxoffload_hf.eager_fallback import EagerWeights
from fxoffload_hf.engine import Engine
from fxoffload_hf.memory import free_host_memory, memory_limit
from fxoffload_hf.memory_model import MemoryModel
from fxoffload_hf.placement import Uses, move_buffers, move_small_parameters, split_parameters, store_weights
from fxoffload_hf.progress import stage
from fxoffload_hf.safetensors_io import CheckpointError, TensorSlice
from fxoffload_hf.undo import (
    AttachedHook,
    OwnedFolder,
    PatchedAttribute,
    StoredParameter,
    SwappedParameter,
    Undo,
)
from fxoffload_hf.weight_record import Tier
from fxoffload_hf.weights import WeightStore

STATE_ATTR = "_fxoffload_state"
# share of free host RAM a GPU run fills with weights read from their files when cpu_memory is not given
_HOST_SHARE_FOR_WEIGHTS = 0.8

T = TypeVar("T")


@dataclass
class _OffloadState:
    """The engine of an offloaded model and the undo records of its install, in the order made."""

    engine: Engine
    undo: list[Undo] = field(default_factory=list)


def offload(
    model: nn.Module,
    *,
    gpu_memory: BudgetSpec = None,
    cpu_memory: BudgetSpec = None,
    offload_folder: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    policy: str = "auto",
    compile: str | None = None,
    capture: str | None = None,
    compile_cache: bool | str | os.PathLike[str] | None = None,
    checkpoint: Mapping[str, TensorSlice] | None = None,
    entry_points: tuple[str, ...] = ("forward",),
) -> nn.Module:
    """Run ``model`` through fxoffload_hf from now on; returns the same object.

    Args:
        model: any ``nn.Module`` that ``torch.compile`` can capture.
        gpu_memory: bytes the engine may use on the compute device (``"8GiB"``, ``"80%"`` of free, an int).
            On a CPU-only run it sizes the pieces as if the device had that much memory.
        cpu_memory: bytes of host RAM for weights; weights beyond it stay on disk.
        offload_folder: where weights that live in memory are written once when they must go to disk
            (default: a temporary folder removed by ``restore``).
        device: compute device; ``None`` means CUDA when available, else CPU.
        policy: ``"auto"`` (profile, then keep the weights whose copy cannot be hidden resident) or
            ``"sequential"`` (stream every piece, keep nothing resident).
        compile: compile each piece: ``"inductor"`` (CPU or GPU) or ``"tensorrt"`` (NVIDIA, with the
            ``tensorrt`` extra installed; without it a warning and the eager pieces).
        capture: ``"deferred"`` (the default; ``$FXOFFLOAD_HF_CAPTURE`` changes it) runs calls eagerly
            first, each module's weights lent for its call as accelerate's hooks do (read in place from
            the checkpoint on the CPU), until they have taken about as long as capture would, then
            captures: a short job's first answer comes without capture's wait, a long one gets the
            streamed schedule. A call runs eagerly only where a bound of its activations from the config
            and its inputs (``eager_memory``) fits the budget beside the largest module's weights;
            otherwise it is captured. ``"first-call"`` captures and plans each entry point at its first
            call.
        compile_cache: where what dynamo captured is kept for the next process with the same model,
            budgets and versions (``fxoffload_hf.compile_cache``): a folder, True for the default
            (``$FXOFFLOAD_HF_COMPILE_CACHE``, else ``~/.cache/fxoffload_hf/compiled``), False for none.
            Left out, it is used without a ``cpu_memory`` budget; with one, only where asked for (a graph
            saved in it holds more memory, which the budget then counts).
        checkpoint: parameter name → where its bytes lie in a safetensors file, for parameters on the
            meta device (used by ``from_pretrained``).
        entry_points: methods of ``model`` to run through the engine.

    Raises:
        ValueError: a bad budget or device, a model that is already offloaded, or a weight larger
            than the budget allows (``BudgetTooSmallError``: the message gives the smallest budget that works).
    """
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("this model is already offloaded; call fxoffload_hf.restore(model) first")
    config = OffloadConfig.build(
        gpu_memory=gpu_memory,
        cpu_memory=cpu_memory,
        offload_folder=offload_folder,
        device=device,
        policy=policy,
        compile=compile,
        capture=capture,
        compile_cache=compile_cache,
    )
    checkpoint = checkpoint or {}
    large, small = split_parameters(model, config, checkpoint)
    undo: list[Undo] = []
    store = WeightStore(config.device, drop_cache=memory_limit() is not None)
    engine: Engine | None = None
    try:
        weight_rescaling.divide_as_used(model, undo)  # before the modules' forwards are wrapped
        fixed = move_small_parameters(small, store, checkpoint, config.device, undo)
        fixed += move_buffers(model, config.device, undo)
        memory = MemoryModel.where_it_computes(
            config.device.type, config.gpu_memory, config.cpu_memory, fixed
        )
        engine = Engine(config, store, memory)
        with stage("weights placed for %s: %s", config.device, store):
            store_weights(large, store, checkpoint)
            if config.device.type == "cpu":
                align.warn_of_unaligned_weights(store)
            # a 2-D weight may stream in tiles of rows (``tiles``)
            memory.check_weights(tiles.streaming_units(store, config.device.type), "weight (or tile of rows)")
            _spill_what_ram_cannot_hold(store, config, fixed)
        if config.device.type == "cuda":
            if store.bytes_in(Tier.DISK):
                with stage("weights read into host RAM for %s: %s", config.device, store):
                    host_room.read_into_ram(store, _host_room(store, config))
            store.pin_host_memory()
        holders = _install_ghosts(large, store, config.device, undo)
        eager = _guard_modules(model, holders, engine, undo, entry_points)
        _tell_deferral_how_calls_are_lent(eager, holders, engine)
        _take_eager_code_paths(model, undo)
        undo.append(eager_paths.EagerPaths())
        # repeated blocks are not stamped out here (``blocks``): dynamo's reuse check let a wrong trace
        # through on one architecture (NeoMME), and exactness comes first; ``plan`` uses them
        entries.wrap(model, entry_points, engine, eager, undo)
    except BaseException:
        _undo(undo)
        if engine is not None:
            engine.close()
        store.close()
        raise
    setattr(model, STATE_ATTR, _OffloadState(engine, undo))
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo ``offload``: the original parameters (values re-read where they went to disk), buffers and
    methods are put back, and the engine's threads and files are released. Returns the same model."""
    state: _OffloadState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model is not offloaded by fxoffload_hf")
    _undo(state.undo)
    state.engine.close()
    state.engine.store.close()
    delattr(model, STATE_ATTR)
    torch._dynamo.reset()
    return model


def is_offloaded(model: nn.Module) -> bool:
    """Whether ``model`` runs through fxoffload_hf now (``offload`` or ``from_pretrained(offload="fx")``)."""
    return getattr(model, STATE_ATTR, None) is not None


def engine_of(model: nn.Module) -> Engine:
    """The engine of an offloaded model (for statistics and plans)."""
    return _state_of(model).engine


def run_as_block(model: nn.Module, calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls`` (each calls the offloaded ``model``: a forward, a ``generate``, a pipeline step) as one
    block: each graph runs once for every call waiting at it, so each streamed weight is loaded once for
    all of them instead of once per call. The results, in order, are identical to making the calls one
    after another. The block holds every call's activations at once; calls whose activations cannot fit
    the budget together are run in smaller groups.
    """
    return engine_of(model).run_together(calls)[0]


def remove_on_restore(model: nn.Module, folder: Path) -> None:
    """Have ``restore`` remove ``folder`` (made for this offloaded model by an integration)."""
    _state_of(model).undo.append(OwnedFolder.of(model, folder))


def _state_of(model: nn.Module) -> _OffloadState:
    state: _OffloadState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model is not offloaded by fxoffload_hf")
    return state


def _undo(records: list[Undo]) -> None:
    while records:
        records.pop().undo()


# -- install steps, in order ------------------------------------------------------------------------
def _spill_what_ram_cannot_hold(store: WeightStore, config: OffloadConfig, fixed: int) -> None:
    """Under ``cpu_memory``, weights in RAM that do not fit it go to disk (the offload folder)."""
    if not MemoryModel(config.cpu_memory, "cpu_memory", fixed).fits(resident=store.ram_bytes()):
        store.spill_ram(config.offload_folder)


def _host_room(store: WeightStore, config: OffloadConfig) -> int:
    """Bytes of host RAM a GPU run may fill with weights read from their files: what ``cpu_memory``
    leaves, or without it most of the free memory (accelerate's ``device_map="auto"`` fills it all)."""
    if config.cpu_memory is not None:
        return max(config.cpu_memory - store.ram_bytes(), 0)
    return int(free_host_memory() * _HOST_SHARE_FOR_WEIGHTS)


def _install_ghosts(
    large: list[tuple[nn.Parameter, Uses]], store: WeightStore, device: torch.device, undo: list[Undo]
) -> set[nn.Module]:
    """Stand a ghost in for every offloaded parameter; the store keeps the only copy of its values.
    Returns the modules that hold ghosts."""
    holders: set[nn.Module] = set()
    for param, uses in large:
        name = uses[0][2]
        record = store.records[name]
        undo.append(StoredParameter(param, store, name))
        ghost = make_ghost(param.shape, param.dtype, device)
        setattr(ghost, HANDLE_ATTR, GhostHandle(store, record))
        for module, attr, _alias in uses:
            undo.append(SwappedParameter(module, attr, param))
            module._parameters[attr] = ghost
            holders.add(module)
        if record.host is not None and record.host.data_ptr() == param.data_ptr():
            store.sharers.setdefault(name, []).append(param)  # emptied if its weight is spilled
        elif param.device.type != "meta":
            param.data = torch.empty(0, dtype=param.dtype)
    return holders


def _guard_modules(
    model: nn.Module, holders: set[nn.Module], engine: Engine, undo: list[Undo], entry_points: tuple[str, ...]
) -> EagerWeights:
    """Give ghosts their values when their module runs eagerly (an entry point's own module: when its
    entry point runs it so), convert ghosts on ``.to()``, refuse state-dict loads. Returns the hooks that
    lend the values."""
    targets = {entries.entry_target(model, entry) for entry in entry_points}
    names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
    borrowed = {
        module: children
        for module in names
        if (children := [c for c in children_read_directly(module) if c in holders])
    }
    lenders = holders | set(borrowed)
    in_order = {m: name for m, name in names.items() if m in lenders}  # the model's order
    eager = EagerWeights(in_order, engine.lock, engine.store, engine.memory, borrowed)
    engine.memory_holders.append(eager)
    room = engine.memory.room(0)
    if room is not None:
        eager.tiles.note(room)
    for module in in_order:
        undo.extend(AttachedHook(handle) for handle in eager.install(module, hooks=module not in targets))
        if module not in holders:
            continue  # lent its children's weights only: their own ``_apply`` converts them
        undo.append(
            PatchedAttribute(module, "_apply", "_apply" in module.__dict__, module.__dict__.get("_apply"))
        )
        module._apply = guarded_apply(module)  # type: ignore[method-assign]
    undo.append(AttachedHook(model.register_load_state_dict_pre_hook(refuse_state_dict_load)))
    return eager


def _tell_deferral_how_calls_are_lent(eager: EagerWeights, holders: set[nn.Module], engine: Engine) -> None:
    """Deferred capture runs calls eagerly, each module lent its weights whole (a plain projection too
    large for that in tiles, ``eager_tiles``); a call that does not fit so is captured, and where its
    capture is refused too the refusal names the budget eager calls need (``Deferral.or_eagerly``). In
    either mode, a kind of call whose capture is refused runs eagerly where it fits so
    (``Deferral.refused_new_graph``). Tells the deferral how eager calls are lent weights, and where
    projections can go in tiles."""
    if engine.memory.room(0) is None or not holders:
        return
    engine.deferral.lending = eager.lending(tiled=False)
    if eager.tiles.rows:
        engine.deferral.tiles = eager


# Module attributes that make a model take, only while dynamo compiles it, another algorithm than the
# eager one (with other rounding): set to the eager choice so the offloaded output is the eager output.
# Transformers' Mamba mixers use a parallel associative scan under compile, a sequential one eagerly.
_COMPILE_ONLY_SWITCHES = {"use_associative_scan": False}


def _take_eager_code_paths(model: nn.Module, undo: list[Undo]) -> None:
    """Turn off the compile-only algorithms above, on the modules and configs that carry them."""
    owners = [*model.modules()]
    owners += [c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None]
    for owner in {id(o): o for o in owners}.values():
        for attr, eager in _COMPILE_ONLY_SWITCHES.items():
            value = getattr(owner, attr, None)
            if isinstance(value, bool) and value != eager:
                undo.append(PatchedAttribute(owner, attr, attr in owner.__dict__, value))
                setattr(owner, attr, eager)


__all__ = ["offload", "restore", "engine_of", "remove_on_restore", "CheckpointError"]
