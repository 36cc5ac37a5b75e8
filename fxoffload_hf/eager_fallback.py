"""Eager fallback: a module that holds offloaded weights but runs outside a captured graph.

Dynamo leaves a module to run eagerly when it cannot capture it (a graph break inside it, its recompile
limit reached), and users call submodules directly (``model.get_input_embeddings()(ids)``). Either way
the module's ``__call__`` runs for real, so forward hooks see it: the pre-hook gives the module's ghosts
their values for the call (read from the store, as accelerate's offload hooks do) and the post-hook
takes them back. The result is exact; the cost is a read that no prefetch hides, so each such module is
named once in a warning. Inside a captured graph the hooks do nothing: the engine feeds the weights.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fxoffload_hf.capture import handle_of
from fxoffload_hf.memory_model import format_bytes


class EagerFallbackWarning(UserWarning):
    """A module with offloaded weights ran eagerly: exact, but its weights were read without prefetch."""


class EagerWeights:
    """The forward hooks of every module that holds ghosts (see the module docstring)."""

    def __init__(self, names: Mapping[nn.Module, str], lock: threading.RLock) -> None:
        self.names = dict(names)
        self.lock = lock
        self.warned: set[nn.Module] = set()
        # per module, a stack (calls may nest) of the ghosts given values and what they held before
        self._swapped: dict[nn.Module, list[list[tuple[nn.Parameter, torch.Tensor]]]] = {}

    def install(self, module: nn.Module) -> list[Any]:
        """Attach the hooks to ``module``; the removable handles.

        A forward that dynamo is told never to trace (``torch.compiler.disable``) would run eagerly
        after its hooks were traced (and did nothing): it is wrapped instead, in a wrapper dynamo does not
        trace either, which gives the weights around the call."""
        if getattr(module.forward, "_torchdynamo_disable", False):
            return [_EagerForward(module, self)]
        return [
            module.register_forward_pre_hook(self.before),
            module.register_forward_hook(self.after, always_call=True),
        ]

    def before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        self.lock.acquire()  # released by ``after``, which runs even when the forward raises
        swapped: list[tuple[nn.Parameter, torch.Tensor]] = []
        lends_grad_flag = not torch.is_grad_enabled()
        self._swapped.setdefault(module, []).append(swapped)
        try:
            for ghost in _ghosts(module):
                handle = handle_of(ghost)
                assert handle is not None
                value = handle.store.read(handle.record).to(ghost.device, ghost.dtype)
                swapped.append((ghost, ghost.data))
                ghost.data = value
                if lends_grad_flag:  # as the runner's weights do (``loaders.as_parameters``)
                    ghost.requires_grad_(handle.record.requires_grad)
            self._warn_once(module, sum(g.numel() * g.element_size() for g, _ in swapped))
        except BaseException:
            self._release(module)
            raise

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        # dynamo may trace a module's pre-hook and leave its post-hook to run eagerly (a graph break
        # inside the call): only a call whose pre-hook gave values has any to take back
        if torch.compiler.is_dynamo_compiling() or not self._swapped.get(module):
            return
        self._release(module)

    def _release(self, module: nn.Module) -> None:
        try:
            stack = self._swapped[module]
            for ghost, held in reversed(stack.pop()):
                ghost.data = held
                ghost.requires_grad_(False)
            if not stack:
                del self._swapped[module]
        finally:
            self.lock.release()

    def _warn_once(self, module: nn.Module, loaded: int) -> None:
        if module in self.warned:
            return
        self.warned.add(module)
        name = self.names.get(module, "")
        warnings.warn(
            f"{type(module).__name__} {name!r} ran outside a captured graph (a graph break inside it, dynamo's "
            f"recompile limit, or a direct call); its weights ({format_bytes(loaded)}) are read for each such "
            "call without prefetch: exact, but slower. Remove the graph break (TORCH_LOGS=graph_breaks shows "
            "it) to stream them",
            EagerFallbackWarning,
            stacklevel=3,
        )


class _EagerForward:
    """``module.forward`` replaced by an untraced wrapper that holds the weights for the call."""

    def __init__(self, module: nn.Module, hooks: EagerWeights) -> None:
        self.module = module
        self.had_own = "forward" in module.__dict__
        self.old = module.__dict__.get("forward")
        original = module.forward

        @torch.compiler.disable
        def forward(*args: Any, **kwargs: Any) -> Any:
            hooks.before(module, args)
            try:
                return original(*args, **kwargs)
            finally:
                hooks.after(module, args, None)

        module.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        if self.had_own:
            self.module.forward = self.old  # type: ignore[method-assign,assignment]
        else:
            self.module.__dict__.pop("forward", None)


def _ghosts(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and handle_of(p) is not None]
