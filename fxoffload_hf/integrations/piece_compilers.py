"""Optional per-piece compilation: Inductor (CPU or GPU) or TensorRT (NVIDIA, optional extra).

Each piece is a small ``GraphModule`` whose weights arrive as ordinary inputs, so a compiler sees
exactly what eager runs; nothing is baked in as a constant.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import fx


def tensorrt_available() -> bool:
    return importlib.util.find_spec("torch_tensorrt") is not None and torch.cuda.is_available()


def compile_piece(piece: fx.GraphModule, backend: str | None) -> Callable[..., Any]:
    """The callable that runs ``piece``: itself, or compiled lazily on its first call by ``backend``."""
    if backend is None:
        return piece
    if backend == "inductor":
        return torch.compile(piece, backend="inductor", dynamic=None)
    if backend == "tensorrt":
        if not tensorrt_available():
            warnings.warn(
                "compile='tensorrt' needs torch-tensorrt and a CUDA device (pip install 'fxoffload_hf[tensorrt]'); "
                "running the pieces eagerly instead",
                RuntimeWarning,
                stacklevel=2,
            )
            return piece
        import torch_tensorrt  # noqa: F401 - registers the "tensorrt" backend

        return torch.compile(piece, backend="tensorrt", dynamic=False)
    raise ValueError(f"compile: {backend!r} is not one of None, 'inductor', 'tensorrt'")
