"""Where each parameter and buffer of a model goes at ``offload``: large parameters into the store (in
RAM as they are, or where the checkpoint holds them), small ones and every buffer onto the compute device
for good, each move written down as an undo record for ``restore``. Tied parameters are one, by identity."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fxoffload_hf.config import OffloadConfig
from fxoffload_hf.memory import tensor_nbytes
from fxoffload_hf.safetensors_io import TensorSlice
from fxoffload_hf.undo import MovedBuffer, SwappedParameter, Undo
from fxoffload_hf.weights import WeightStore

Uses = list[tuple[nn.Module, str, str]]  # every (module, attribute, dotted name) holding one parameter


def split_parameters(
    model: nn.Module, config: OffloadConfig, checkpoint: Mapping[str, TensorSlice]
) -> tuple[list[tuple[nn.Parameter, Uses]], list[tuple[nn.Parameter, Uses]]]:
    """The model's distinct parameters, large ones (offloaded) and small ones (kept on the device)."""
    large: list[tuple[nn.Parameter, Uses]] = []
    small: list[tuple[nn.Parameter, Uses]] = []
    for param, uses in parameter_owners(model).items():
        name = uses[0][2]
        if param.device.type == "meta" and name not in checkpoint:
            raise ValueError(
                f"parameter {name!r} is on the meta device and no checkpoint file holds it; "
                "load the model's weights first, or load it with fxoffload_hf.from_pretrained"
            )
        (large if tensor_nbytes(param) >= config.resident_threshold else small).append((param, uses))
    return large, small


def move_small_parameters(
    small: list[tuple[nn.Parameter, Uses]],
    store: WeightStore,
    checkpoint: Mapping[str, TensorSlice],
    device: torch.device,
    undo: list[Undo],
) -> int:
    """Put the small parameters on the compute device for good; their bytes."""
    fixed = 0
    for param, uses in small:
        value = param.data
        if param.device.type == "meta":
            value = store.read_source(checkpoint[uses[0][2]], param.dtype)
        if value.device != device:
            value = value.to(device)
        if value is not param.data:
            replacement = nn.Parameter(value, requires_grad=param.requires_grad)
            for module, attr, _name in uses:
                undo.append(SwappedParameter(module, attr, param))
                module._parameters[attr] = replacement
        fixed += tensor_nbytes(param)
    return fixed


def move_buffers(model: nn.Module, device: torch.device, undo: list[Undo]) -> int:
    """Put every buffer on the compute device; their bytes."""
    fixed = 0
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None:
                continue
            if buf.device != device:
                undo.append(MovedBuffer(module, name, buf))
                module._buffers[name] = buf.to(device)
            fixed += tensor_nbytes(buf)
    return fixed


def store_weights(
    large: list[tuple[nn.Parameter, Uses]], store: WeightStore, checkpoint: Mapping[str, TensorSlice]
) -> None:
    """Record each large parameter in the store: in RAM as it is, or where the checkpoint holds it."""
    for param, uses in large:
        name = uses[0][2]
        if param.device.type == "meta":
            store.add_disk(name, checkpoint[name], param.dtype, requires_grad=param.requires_grad)
        else:
            store.add_host(name, param.data, requires_grad=param.requires_grad)
        for _module, _attr, alias in uses[1:]:
            store.add_alias(name, alias)


def parameter_owners(model: nn.Module) -> dict[nn.Parameter, Uses]:
    """Each distinct parameter with every (module, attribute, dotted name) that holds it: tied ones once."""
    owners: dict[nn.Parameter, Uses] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            full = f"{module_name}.{attr}" if module_name else attr
            uses = owners.setdefault(param, [])
            if all(m is not module or a != attr for m, a, _ in uses):
                uses.append((module, attr, full))
    return owners
