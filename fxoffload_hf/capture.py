"""Capture: ghost parameters in the module, and the ``torch.compile`` backend that receives its graphs.

A ghost stands in for an offloaded parameter: same shape, dtype and device, but a zero-stride view of
one NaN, so whole-module ``.to()`` calls cost nothing and any computation that reads it outside a
captured graph gives NaN rather than a plausible number. A forward pre-hook on every module that owns
a ghost also refuses eager calls outside the engine with a clear error. Inside a captured graph the
ghost is a placeholder whose handle tells the executor which stored weight to feed in its place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fxoffload_hf.weights import WeightRecord

if TYPE_CHECKING:
    from fxoffload_hf.engine import Engine

HANDLE_ATTR = "_fxoffload_handle"
_inside = threading.local()


@dataclass(frozen=True)
class GhostHandle:
    """Attached to a ghost: the engine and the record of the weight it stands for."""

    engine: Engine
    record: WeightRecord


class OffloadedWeightAccessError(RuntimeError):
    """An offloaded module was run outside the engine, where its weights are not present."""


def make_ghost(shape: torch.Size | tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """A parameter of ``shape`` that holds one NaN element broadcast to the full shape."""
    seed = torch.full((1,), float("nan"), dtype=dtype, device=device)
    return nn.Parameter(seed.expand(shape), requires_grad=False)


def handle_of(value: Any) -> GhostHandle | None:
    return getattr(value, HANDLE_ATTR, None)


def is_inside_engine() -> bool:
    return getattr(_inside, "depth", 0) > 0


class inside_engine:  # noqa: N801 - used as a context manager
    """Marks the current thread as running an offloaded forward."""

    def __enter__(self) -> None:
        _inside.depth = getattr(_inside, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _inside.depth -= 1


def guard_hook(module: nn.Module, args: Any) -> None:
    """Forward pre-hook on modules holding ghosts: refuse eager calls outside the engine."""
    if torch.compiler.is_compiling():
        return
    if not is_inside_engine():
        raise OffloadedWeightAccessError(
            f"{type(module).__name__} holds weights offloaded by fxoffload_hf and was called directly; "
            "call the offloaded model itself, or fxoffload_hf.restore(model) first"
        )


def compile_entry(fn: Callable[..., Any], backend: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` ``fn`` with our backend; dynamic shapes are found automatically on recompiles."""
    return torch.compile(fn, backend=backend, dynamic=None, fullgraph=False)
