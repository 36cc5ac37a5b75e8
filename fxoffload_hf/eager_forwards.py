"""The forwards that lend a module its weights around an eager call where hooks cannot (``eager_fallback``).

A forward that dynamo is told never to trace gets an untraced wrapper that lends around it
(``EagerForward``); every other module holding ghosts gets one that lends where dynamo traced its pre-hook
and the forward then ran for real (``LendsAfterBreak``). Inside either, a plain embedding's table is read
by rows where it lies and a projection too large to lend whole is computed in tiles (``eager_tiles``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection
from types import FunctionType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._dynamo.eval_frame import skip_code
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fxoffload_hf.row_lookups import gather_rows

if TYPE_CHECKING:
    from fxoffload_hf.eager_fallback import EagerWeights


class ReplacedMethod:
    """``module.<name>`` replaced by ``method`` as an attribute of the instance; ``remove`` puts back
    what was there (a removable handle, as the hooks' are)."""

    def __init__(self, module: nn.Module, method: Any, name: str = "forward") -> None:
        self.module = module
        self.name = name
        self.had_own = name in module.__dict__
        self.old = module.__dict__.get(name)
        setattr(module, name, method)

    def remove(self) -> None:
        if self.had_own:
            setattr(self.module, self.name, self.old)
        else:
            self.module.__dict__.pop(self.name, None)


class EagerForward(ReplacedMethod):
    """``module.forward`` replaced by an untraced wrapper that holds the weights for the call."""

    def __init__(self, module: nn.Module, hooks: EagerWeights) -> None:
        original = module.forward

        @torch.compiler.disable
        def forward(*args: Any, **kwargs: Any) -> Any:
            hooks.before(module, args)
            try:
                return original(*args, **kwargs)
            finally:
                hooks.after(module, args, None)

        super().__init__(module, forward)


class LendsAfterBreak(ReplacedMethod):
    """``module.forward`` wrapped for a forward that runs for real after dynamo traced its pre-hook.

    Dynamo traces a module's call, its pre-hook with it (which does nothing while dynamo traces); a graph
    break inside the forward that dynamo cannot resume there (inside a loop over a tensor, as in some
    mixture-of-experts layers) ends the graph at the call of ``forward`` in the module's ``__call__``,
    and the forward then runs for real with no weights lent: its ghosts read as NaN. Traced, this wrapper
    is the forward itself; run as a frame of its own (dynamo never compiles it: ``skip_code``), it lends
    the weights for the call unless the hooks did. Dynamo may still capture graphs around the break
    inside (fed by the engine); whether it gave up on part of the forward is not known before that part
    runs, so the weights are lent for every such call: exact first, at the cost of a read."""

    def __init__(self, module: nn.Module, hooks: EagerWeights) -> None:
        super().__init__(module, _lending_forward(module, module.forward, hooks))


class LendsToMethod(ReplacedMethod):
    """A method of a module, other than its forward, that may read the module's weights, wrapped as
    ``LendsAfterBreak`` wraps the forward: a caller outside the module may call it instead of the module
    (ProphetNet's decoder calls its position embedding's ``_forward``, ``nn.Embedding.forward`` reached
    without ``__call__``), where no hook lends the weights (``methods_reading_weights``)."""

    def __init__(self, module: nn.Module, name: str, hooks: EagerWeights) -> None:
        method = _lending_forward(module, getattr(module, name), hooks, own_forward=False)
        super().__init__(module, method, name)


_LAZY = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def methods_reading_weights(module: nn.Module, weight_names: Collection[str]) -> list[str]:
    """The methods of a leaf ``module`` (one without children: a model or a layer made of modules is
    called, not its helpers) that may read its weights without its forward hooks: those its own class
    and the classes between it and torch's define, other than ``nn.Module``'s own (``forward``,
    ``extra_repr``) and special names, whose code names ``forward`` (``super().forward(...)``) or one of
    ``weight_names``."""
    if next(module.children(), None) is not None:
        return []
    wanted = {"forward", *weight_names}
    found: list[str] = []
    for cls in type(module).__mro__:
        if cls.__module__.startswith("torch.") or cls is object:
            break
        for name, value in vars(cls).items():
            if (
                isinstance(value, FunctionType)
                and not value.__code__.co_flags & _LAZY  # lent for the call: its result computed in it
                and not hasattr(nn.Module, name)  # forward, extra_repr: torch's, called by it or for it
                and not name.startswith("__")
                and name not in found
                and wanted.intersection(value.__code__.co_names)
            ):
                found.append(name)
    return found


def _lending_forward(module: nn.Module, original: Any, hooks: EagerWeights, own_forward: bool = True) -> Any:
    by_rows = own_forward and plain_lookup(module)

    def run(*args: Any, **kwargs: Any) -> Any:
        if by_rows and args and module.weight.device != args[0].device:
            return gather_rows(args[0], module.weight)  # lent where it lies (``Way.ROWS``): gathered there
        if own_forward and hooks.tiles.in_tiles(module):
            return hooks.tiles.project(module, args[0] if args else kwargs["input"])
        return original(*args, **kwargs)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return original(*args, **kwargs)
        if hooks.holds(module):
            return run(*args, **kwargs)
        _lend(hooks, module, args)
        try:
            return run(*args, **kwargs)
        finally:
            _give_back(hooks, module, args)

    forward.lends_weights = True  # type: ignore[attr-defined]
    skip_code(forward.__code__)  # type: ignore[attr-defined]  # every wrapper shares this code object
    return forward


# called from a frame dynamo skips, inside a compiled call: dynamo would compile their frames (and see
# itself compiling), so they are run as they are
@torch.compiler.disable
def _lend(hooks: EagerWeights, module: nn.Module, args: Any) -> None:
    hooks.before(module, args)


@torch.compiler.disable
def _give_back(hooks: EagerWeights, module: nn.Module, args: Any) -> None:
    hooks.after(module, args, None)


def unwrapped_forward(forward: Any) -> Any:
    """``forward`` without ``LendsAfterBreak``'s wrapper (an entry point is compiled as itself)."""
    return forward.__wrapped__ if getattr(forward, "lends_weights", False) else forward


def plain_lookup(module: nn.Module) -> bool:
    """Whether ``module`` is a plain ``nn.Embedding`` (its own forward, no ``max_norm``): its call is one
    lookup, which rows gathered where the table lies can stand in for."""
    return type(module).forward is nn.Embedding.forward and getattr(module, "max_norm", 1) is None


def reads_rows(module: nn.Module, device_type: str) -> bool:
    """Whether an eager call of ``module`` on ``device_type`` reads only rows of its table, so that the
    table is lent where it lies (its rows read as looked up): a plain ``nn.Embedding``; on the CPU, where
    the module's own forward runs on the lent table, also an embedding whose forward touches its table
    only through lookups (Transformers' scaled word embeddings, ``super().forward(ids) * scale``),
    checked once per class by running it on one token (``_looks_up_only``)."""
    if plain_lookup(module):
        return True
    if device_type != "cpu" or not isinstance(module, nn.Embedding) or module.max_norm is not None:
        return False
    known = _LOOKS_UP_ONLY.get(type(module))
    if known is None:
        known = _LOOKS_UP_ONLY[type(module)] = _looks_up_only(module)
    return known


_LOOKS_UP_ONLY: dict[type, bool] = {}  # by embedding class with a forward of its own


class _TableUses(TorchDispatchMode):
    """Records the ops that take ``table`` as an argument."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(leaf is self.table for leaf in tree_leaves((args, kwargs))):
            self.ops.add(str(func.overloadpacket))
        return func(*args, **kwargs)


@torch.compiler.disable
def _looks_up_only(module: nn.Embedding) -> bool:
    """Whether ``module``'s forward, called with one token id, passes its table to no op but lookups
    (reading ``.dtype`` or ``.device`` is no op). A forward that needs other arguments (a positional
    embedding computing its positions) or fails is taken as reading more."""
    table = module.weight
    ids = torch.zeros(1, 1, dtype=torch.long, device=table.device)
    uses = _TableUses(table)
    try:
        with uses, torch.no_grad():
            type(module).forward(module, ids)
    except Exception:  # noqa: BLE001 - any failure: lent whole, as before this check
        return False
    return uses.ops == {"aten.embedding"}
