"""Hugging Face's ``from_pretrained`` keywords, read with Hugging Face's meaning for an offloaded load.

``max_memory`` and ``device_map="auto"`` become fxoffload's budgets and placement; keywords that only
shape the model (``attn_implementation``, config overrides, ``revision``, ...) pass through to
transformers; keywords that ask for a placement or a format fxoffload cannot give are refused with what
to do instead. Nothing is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fxoffload_hf.config import BudgetSpec

# Keywords whose job fxoffload does itself, or that change what transformers returns or loads in a way
# the offloaded load cannot follow; each with the reason given to the user.
REFUSED: dict[str, str] = {
    "quantization_config": "quantized weights are not supported; load the full-precision checkpoint",
    "load_in_8bit": "quantized weights are not supported; load the full-precision checkpoint",
    "load_in_4bit": "quantized weights are not supported; load the full-precision checkpoint",
    "gguf_file": "GGUF checkpoints are not supported; convert to safetensors (save_pretrained)",
    "tp_plan": "tensor parallelism places weights on several devices; fxoffload streams to one",
    "tp_size": "tensor parallelism places weights on several devices; fxoffload streams to one",
    "device_mesh": "tensor parallelism places weights on several devices; fxoffload streams to one",
    "distributed_config": "distributed loading places weights on several devices; fxoffload streams to one",
    "state_dict": "weights come from the checkpoint files; save the state dict with save_pretrained first",
    "output_loading_info": "the offloaded load returns the model only",
    "offload_state_dict": "fxoffload never loads the whole state dict; leave it out",
    "offload_buffers": "buffers are small and stay on the compute device; leave it out",
    "low_cpu_mem_usage": "the offloaded load always reads weights lazily; leave it out",
    "disable_mmap": "fxoffload reads weights through memory maps; leave it out",
    "adapter_name": "PEFT adapters are not supported under offload; merge them into the weights first",
    "adapter_kwargs": "PEFT adapters are not supported under offload; merge them into the weights first",
    "use_kernels": "hub kernels replace modules after loading; not supported under offload",
    "kernel_config": "hub kernels replace modules after loading; not supported under offload",
}


@dataclass(frozen=True)
class Placement:
    """fxoffload's placement options after Hugging Face's keywords are read."""

    gpu_memory: BudgetSpec
    cpu_memory: BudgetSpec
    device: str | torch.device | None
    dtype: torch.dtype | str | None


def read_hf_placement(
    hf_kwargs: dict[str, Any],
    *,
    gpu_memory: BudgetSpec,
    cpu_memory: BudgetSpec,
    device: str | torch.device | None,
    dtype: torch.dtype | str | None,
) -> tuple[Placement, dict[str, Any]]:
    """Split ``hf_kwargs`` into fxoffload's placement and the keywords passed on to transformers.

    Raises:
        ValueError: a keyword fxoffload cannot honour, or two keywords that say the same thing.
    """
    passed = dict(hf_kwargs)
    refused = sorted(k for k in passed if k in REFUSED)
    if refused:
        key = refused[0]
        raise ValueError(f"from_pretrained(offload='fx') cannot honour {key}=: {REFUSED[key]}")
    device_map = passed.pop("device_map", None)
    if device_map is not None and device_map != "auto":
        raise ValueError(
            f"device_map={device_map!r} cannot be combined with offload='fx': fxoffload places every weight "
            "itself; pass device_map='auto' or leave it out, and bound memory with max_memory "
            "(or gpu_memory/cpu_memory)"
        )
    if "torch_dtype" in passed:
        if dtype is not None:
            raise ValueError("pass dtype or torch_dtype, not both (torch_dtype is the older name of dtype)")
        dtype = passed.pop("torch_dtype")
    max_memory = passed.pop("max_memory", None)
    placement = Placement(gpu_memory, cpu_memory, device, dtype)
    if max_memory is not None:
        placement = _from_max_memory(max_memory, placement)
    return placement, passed


def _from_max_memory(max_memory: Any, given: Placement) -> Placement:
    """Hugging Face's ``max_memory`` (GPU index or ``"cpu"`` → size) as fxoffload's budgets and device."""
    if not isinstance(max_memory, Mapping) or not max_memory:
        raise ValueError(
            f"max_memory: expected a dict like {{0: '10GiB', 'cpu': '30GiB'}}, got {max_memory!r:.60}"
        )
    if given.gpu_memory is not None or given.cpu_memory is not None:
        raise ValueError(
            "pass max_memory or gpu_memory/cpu_memory, not both: they set the same budgets "
            "(max_memory={0: gpu_memory, 'cpu': cpu_memory})"
        )
    gpus = {_gpu_index(key): value for key, value in max_memory.items() if key != "cpu"}
    if len(gpus) > 1:
        raise ValueError(
            f"max_memory names {len(gpus)} GPUs ({sorted(gpus)}); fxoffload streams to one device: "
            "give one GPU index, e.g. max_memory={0: '10GiB', 'cpu': '30GiB'}"
        )
    device = given.device
    if gpus:
        ((index, gpu_memory),) = gpus.items()
        if device is not None and torch.device(device) != torch.device("cuda", index):
            raise ValueError(f"max_memory is for GPU {index} but device={device!r}; make them agree")
        device = device if device is not None else f"cuda:{index}"
    else:
        gpu_memory = None
        # no GPU named: Hugging Face would place nothing on a GPU, so neither do we
        device = device if device is not None else "cpu"
    return Placement(gpu_memory, max_memory.get("cpu"), device, given.dtype)


def _gpu_index(key: Any) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.startswith("cuda:") and key[5:].isdigit():
        return int(key[5:])
    raise ValueError(
        f"max_memory: key {key!r} is not a GPU index or 'cpu'; write e.g. {{0: '10GiB', 'cpu': '30GiB'}} "
        "(disk needs no limit: weights beyond these stay in their files)"
    )
