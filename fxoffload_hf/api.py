"""The public API: ``offload(model, ...)`` and ``restore(model)``."""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxoffload_hf.capture import (
    HANDLE_ATTR,
    GhostHandle,
    compile_entry,
    guard_hook,
    guarded_apply,
    inside_engine,
    make_ghost,
    refuse_state_dict_load,
)
from fxoffload_hf.config import BudgetSpec, OffloadConfig
from fxoffload_hf.engine import Engine
from fxoffload_hf.memory import format_bytes, tensor_nbytes
from fxoffload_hf.safetensors_io import CheckpointError, TensorSlice
from fxoffload_hf.weights import WeightStore

STATE_ATTR = "_fxoffload_state"


@dataclass
class _OffloadState:
    """Everything ``restore`` needs to put the model back as it was."""

    engine: Engine
    params: list[tuple[nn.Module, str, nn.Parameter, str]]  # owner, attribute, original, record name
    moved_buffers: list[tuple[nn.Module, str, torch.Tensor]]
    moved_params: list[tuple[nn.Module, str, nn.Parameter]]
    entries: list[tuple[nn.Module, str, bool, Any]]  # module, method name, had own attribute, old value
    hooks: list[Any] = field(default_factory=list)
    temp_folder: Path | None = None  # a folder an integration made for this model, removed by restore


def offload(
    model: nn.Module,
    *,
    gpu_memory: BudgetSpec = None,
    cpu_memory: BudgetSpec = None,
    offload_folder: str | os.PathLike[str] | None = None,
    device: str | torch.device | None = None,
    policy: str = "auto",
    compile: str | None = None,
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
        checkpoint: parameter name → where its bytes lie in a safetensors file, for parameters on the
            meta device (used by ``from_pretrained``).
        entry_points: methods of ``model`` to run through the engine.

    Raises:
        ValueError: a bad budget or device, a model that is already offloaded, or a weight larger
            than the budget allows (the message gives the smallest budget that works).
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
    )
    checkpoint = checkpoint or {}
    store = WeightStore(config.device)
    owners = _parameter_owners(model)
    large: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]], str]] = []
    small: list[tuple[nn.Parameter, list[tuple[nn.Module, str, str]], str]] = []
    for param, uses in owners.items():
        name = uses[0][2]
        on_meta = param.device.type == "meta"
        if on_meta and name not in checkpoint:
            raise ValueError(
                f"parameter {name!r} is on the meta device and no checkpoint file holds it; "
                "load the model's weights first, or load it with fxoffload_hf.from_pretrained"
            )
        (large if tensor_nbytes(param) >= config.resident_threshold else small).append((param, uses, name))

    moved_params: list[tuple[nn.Module, str, nn.Parameter]] = []
    fixed = 0
    for param, uses, name in small:
        value = param.data
        if param.device.type == "meta":
            value = store.read(store.add_disk(name, checkpoint[name], param.dtype))
            del store.records[name]
        if value.device != config.device:
            value = value.to(config.device)
        if value is not param.data:
            replacement = nn.Parameter(value, requires_grad=param.requires_grad)
            for module, attr, _full in uses:
                moved_params.append((module, attr, param))
                module._parameters[attr] = replacement
        fixed += tensor_nbytes(param)
    moved_buffers = []
    for module in model.modules():
        for bname, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.device != config.device:
                moved_buffers.append((module, bname, buf))
                module._buffers[bname] = buf.to(config.device)
            fixed += tensor_nbytes(buf)

    state = _OffloadState(Engine(config, store, fixed), [], moved_buffers, moved_params, [])
    try:
        for param, uses, name in large:
            if param.device.type == "meta":
                store.add_disk(name, checkpoint[name], param.dtype)
            else:
                store.add_host(name, param.data)
            for _module, _attr, alias in uses[1:]:
                store.add_alias(name, alias)
        _check_fits(state.engine, [r.footprint for r in store.records.values()])
        host_names = [n for n, r in store.records.items() if r.host is not None]
        host_bytes = sum(store.records[n].nbytes for n in host_names)
        if config.cpu_memory is not None and host_bytes > config.cpu_memory - fixed:
            store.spill_to_disk(host_names, store.spill_folder(config.offload_folder))
        if config.device.type == "cuda":
            store.pin_host_memory()
        for param, uses, name in large:
            record = store.records[name]
            ghost = make_ghost(param.shape, param.dtype, config.device)
            setattr(ghost, HANDLE_ATTR, GhostHandle(state.engine, record))
            for module, attr, _alias in uses:
                state.params.append((module, attr, param, name))
                module._parameters[attr] = ghost
            shares_host = record.host is not None and record.host.data_ptr() == param.data_ptr()
            if shares_host:
                store.sharers.setdefault(name, []).append(param)
            elif param.device.type != "meta":
                param.data = torch.empty(0, dtype=param.dtype)  # the store holds the only copy
        for module in {m for m, *_ in state.params}:
            state.hooks.append(module.register_forward_pre_hook(guard_hook))
            state.entries.append(
                (module, "_apply", "_apply" in module.__dict__, module.__dict__.get("_apply"))
            )
            module._apply = guarded_apply(module)  # type: ignore[method-assign]
        state.hooks.append(model.register_load_state_dict_pre_hook(refuse_state_dict_load))
        for entry in entry_points:
            _wrap_entry(model, entry, state)
    except BaseException:
        _undo(model, state)
        raise
    setattr(model, STATE_ATTR, state)
    return model


def restore(model: nn.Module) -> nn.Module:
    """Undo ``offload``: the original parameters (values re-read where they went to disk), buffers and
    methods are put back, and the engine's threads and files are released. Returns the same model."""
    state: _OffloadState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model is not offloaded by fxoffload_hf")
    _undo(model, state)
    delattr(model, STATE_ATTR)
    return model


def engine_of(model: nn.Module) -> Engine:
    """The engine of an offloaded model (for statistics and plans)."""
    state: _OffloadState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("this model is not offloaded by fxoffload_hf")
    return state.engine


def _undo(model: nn.Module, state: _OffloadState) -> None:
    store = state.engine.store
    for module, attr, had_own, old in reversed(state.entries):
        if had_own:
            setattr(module, attr, old)
        else:
            module.__dict__.pop(attr, None)
    for hook in state.hooks:
        hook.remove()
    for module, attr, original, name in state.params:
        record = store.records.get(name)
        if record is not None and record.host is not None:
            original.data = record.host  # the same tensor, unless model.to(dtype) converted it
        elif record is not None and original.device.type != "meta":
            original.data = store.read(record).clone()
        module._parameters[attr] = original
    for module, attr, original_param in state.moved_params:
        module._parameters[attr] = original_param
    for module, bname, buf in state.moved_buffers:
        module._buffers[bname] = buf
    state.engine.close()
    store.close()
    if state.temp_folder is not None:
        shutil.rmtree(state.temp_folder, ignore_errors=True)
    torch._dynamo.reset()


def _parameter_owners(model: nn.Module) -> dict[nn.Parameter, list[tuple[nn.Module, str, str]]]:
    """Each distinct parameter with every (module, attribute, dotted name) that holds it: tied ones once."""
    owners: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            full = f"{module_name}.{attr}" if module_name else attr
            uses = owners.setdefault(param, [])
            if all(m is not module or a != attr for m, a, _ in uses):
                uses.append((module, attr, full))
    return owners


def _check_fits(engine: Engine, sizes: list[int]) -> None:
    """Refuse up front a budget that cannot hold two of the largest weights (activations come later)."""
    budget = engine.budget
    if budget is None or not sizes:
        return
    smallest = engine.smallest_budget(max(sizes), 0)
    if smallest > budget:
        raise ValueError(
            f"{engine.budget_name}={format_bytes(budget)} is too small: the largest weight takes "
            f"{format_bytes(max(sizes))} and two must fit at once beside {format_bytes(engine.fixed_bytes)} of "
            f"small resident tensors; pass {engine.budget_name}={smallest} or more (plus room for activations)"
        )


def _wrap_entry(model: nn.Module, entry: str, state: _OffloadState) -> None:
    target = model
    for part in entry.split(".")[:-1]:
        target = getattr(target, part)
    attr = entry.split(".")[-1]
    had_own = attr in target.__dict__
    original = getattr(target, attr)
    compiled = compile_entry(original, state.engine)
    engine = state.engine

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            # traced as part of another entry point (an encoder inside the full forward): inline it
            return original(*args, **kwargs)
        with engine.lock, inside_engine():
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                # a budget refused while a graph is captured reaches the caller as itself
                inner = getattr(exc, "inner_exception", None)
                if isinstance(inner, ValueError):
                    raise inner from None
                raise

    state.entries.append((target, attr, had_own, target.__dict__.get(attr)))
    setattr(target, attr, run)


__all__ = ["offload", "restore", "engine_of", "CheckpointError"]
