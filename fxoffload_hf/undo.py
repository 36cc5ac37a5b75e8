"""The undo records of ``offload``'s install steps: each names one change made to the model and how to
take it back. ``restore`` (or a failed install) undoes them in reverse."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from fxoffload_hf.spill_files import remove_written
from fxoffload_hf.weights import WeightStore


class Undo(Protocol):
    def undo(self) -> None: ...


@dataclass(frozen=True)
class SwappedParameter:
    """A parameter slot given another tensor (a ghost, or a small weight moved to the device)."""

    module: nn.Module
    attr: str
    original: nn.Parameter

    def undo(self) -> None:
        self.module._parameters[self.attr] = self.original


@dataclass(frozen=True)
class StoredParameter:
    """An offloaded parameter whose values the store holds (the only copy): they are given back to it."""

    original: nn.Parameter
    store: WeightStore
    name: str

    def undo(self) -> None:
        record = self.store.records.get(self.name)
        if record is None or self.original.device.type == "meta":
            return  # a parameter loaded from a checkpoint by fxoffload was never in memory: it stays so
        if record.host is not None:
            self.original.data = record.host  # the same tensor, unless model.to(dtype) converted it
        else:
            self.original.data = self.store.read(record).clone()


@dataclass(frozen=True)
class MovedBuffer:
    module: nn.Module
    attr: str
    original: torch.Tensor

    def undo(self) -> None:
        self.module._buffers[self.attr] = self.original


@dataclass(frozen=True)
class PatchedAttribute:
    """An attribute set on an object (an entry point, a module's ``_apply``, a package global)."""

    owner: Any
    attr: str
    had_own: bool
    old: Any

    def undo(self) -> None:
        if self.had_own:
            setattr(self.owner, self.attr, self.old)
        else:
            self.owner.__dict__.pop(self.attr, None)


@dataclass(frozen=True)
class AttachedHook:
    handle: Any  # torch.utils.hooks.RemovableHandle

    def undo(self) -> None:
        self.handle.remove()


@dataclass(frozen=True)
class OwnedFolder:
    """A folder made for a model (by an integration), removed with it: at ``restore``, else when the
    model is collected or the interpreter exits (a process that never restores its model leaves none)."""

    path: Path
    removal: weakref.finalize

    @classmethod
    def of(cls, model: nn.Module, path: Path) -> OwnedFolder:
        return cls(path, weakref.finalize(model, remove_written, [path], os.getpid()))

    def undo(self) -> None:
        self.removal()
