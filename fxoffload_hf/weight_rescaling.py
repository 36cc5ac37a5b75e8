"""Models that rescale their own weights in place at their first eager call, made to divide as they use
them instead.

RWKV (``RwkvModel``, with ``config.rescale_every`` > 0, as RWKV-4's checkpoints have it) divides, at its
first call in eval mode, the output projections of block ``b``'s attention and feed-forward by
``2 ** (b // rescale_every)`` in place (``_rescale_layers``), then halves its hidden states every
``rescale_every`` blocks, so that fp16 activations do not overflow. An offloaded weight is read afresh
from its file at each use, so a division written into one copy is lost: the offloaded model gave other
logits than eager's (measured: 1.58 apart on a tiny model). Instead the model is told its layers are
rescaled, and each such projection divides its weight as it uses it: the values eager divided in place,
bit for bit (dividing its input instead rounds otherwise in fp16, where small inputs become subnormal),
at the cost of one copy of that weight per call (counted by the eager bound,
``linear_families.rwkv_computing``; a captured graph measures it); the weights are never written.
``restore`` takes both back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxoffload_hf.undo import PatchedAttribute, Undo

# per model class: the projections of a block its rescaling divides (attribute paths from the block)
_RESCALED = {"RwkvModel": ("attention.output", "feed_forward.value")}


class DividingLinear(nn.Linear):
    """A projection whose weight is divided by ``divisor`` as it is used."""

    divisor: float

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own name
        return F.linear(input, self.weight / self.divisor, self.bias)


@dataclass(frozen=True)
class DividedProjection:
    """A projection made a ``DividingLinear``: its class and attributes given back."""

    module: nn.Module
    original: type

    def undo(self) -> None:
        self.module.__class__ = self.original
        self.module.__dict__.pop("divisor", None)


def divide_as_used(model: nn.Module, undo: list[Undo]) -> None:
    """Where a module of ``model`` would rescale its weights in place at its next call, mark it rescaled
    and make the projections it would divide divide their weights as they use them (undone through
    ``undo``). Call before the model's modules are wrapped: they wrap the projections' new forward."""
    for owner in model.modules():
        projections = _RESCALED.get(type(owner).__name__)
        every = getattr(getattr(owner, "config", None), "rescale_every", 0)
        if projections is None or not isinstance(every, int) or every <= 0:
            continue
        if getattr(owner, "layers_are_rescaled", False):
            continue  # it ran eagerly before it was offloaded: its weights in memory are divided already
        had_own = "layers_are_rescaled" in owner.__dict__
        undo.append(PatchedAttribute(owner, "layers_are_rescaled", had_own, False))
        setattr(owner, "layers_are_rescaled", True)  # noqa: B010 - a model's own attribute, not a module's
        blocks: nn.ModuleList = getattr(owner, "blocks")  # noqa: B009 - RWKV's blocks
        for index, block in enumerate(blocks):
            divisor = 2 ** (index // every)
            for path in projections if divisor > 1 else ():
                projection = block.get_submodule(path)
                if type(projection) is not nn.Linear:
                    raise NotImplementedError(
                        f"{type(owner).__name__} rescales {path} in place, and it is a "
                        f"{type(projection).__name__}, not a plain nn.Linear: offloading it is not supported"
                    )
                _drop_bound_forward(projection, undo)
                undo.append(DividedProjection(projection, nn.Linear))
                projection.__class__ = DividingLinear
                projection.__dict__["divisor"] = float(divisor)


def _drop_bound_forward(projection: nn.Module, undo: list[Undo]) -> None:
    """Remove an instance's ``forward`` that is only its class's own, bound (what accelerate leaves when it
    removes its hooks: Transformers' loading onto the meta device adds them), so that the class's counts."""
    own = projection.__dict__.get("forward")
    if own is None:
        return
    if (
        getattr(own, "__func__", None) is not nn.Linear.forward
        or getattr(own, "__self__", None) is not projection
    ):
        raise NotImplementedError(
            f"a projection that rescales its weight in place has a forward of its own ({own!r}): offloading "
            "it is not supported"
        )
    undo.append(PatchedAttribute(projection, "forward", True, own))
    del projection.__dict__["forward"]


def weight_write_error(name: str, how: str) -> NotImplementedError:
    """The refusal of a model that writes into its weight ``name`` as it runs (``how``: the op, or where)."""
    return NotImplementedError(
        f"the model writes into its weight {name} in place as it runs ({how}): an offloaded weight is read "
        "afresh from its file at each use, so the write would be lost and the output differ from eager's. "
        "This model is not supported by offload='fx': load it without it"
    )
