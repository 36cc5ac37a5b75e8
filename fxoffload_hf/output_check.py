"""A look for NaN in the outputs of a model's first eager calls: the sign of a weight read unlent.

An eager call (deferred capture's first calls, a module called outside its captured graph) lends each
module its weights for its own call (``eager_fallback``), with those of the children its code reads
without calling them (``direct_reads``). Outside those calls a stored weight is a ghost whose every value
is NaN, so that a read fxoffload does not see gives NaN, not a plausible number: a module reading a
*grandchild*'s weight, or a large child's in a path taken rarely (Gemma 4's multimodal model reads a row of
its text model's embedding table when images are in the prompt). The first eager calls of a model (a
prompt and its first decode steps take different paths) have their output looked at, and NaN there warns,
naming the way around it. Only the first few: the look waits for the device. So a path a model takes only
later (the images of a later prompt) is not looked at.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

# eager calls of a model whose output is looked at (a prefill, the first decode steps)
CHECKED_CALLS = 4
_PREFERRED = ("logits", "last_hidden_state")  # a ModelOutput's main output, ahead of a loss


class NaNOutputWarning(UserWarning):
    """An eager call of an offloaded model gave NaN: a weight may have been read outside the calls that
    are lent it."""


def main_output(output: Any) -> torch.Tensor | None:
    """The floating-point tensor a call's output leads with: a ``ModelOutput``'s logits or last hidden
    state, else its first floating-point tensor (a tuple's, a dict's), or the tensor itself."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, Mapping):
        for key in _PREFERRED:
            found = main_output(output.get(key))
            if found is not None:
                return found
        values: Any = output.values()
    elif isinstance(output, tuple | list):
        values = output
    else:
        return None
    for value in values:
        if isinstance(value, torch.Tensor | Mapping | tuple | list):
            found = main_output(value)
            if found is not None:
                return found
    return None


def warn_on_nan(output: Any, calls_before: int, model_name: str) -> None:
    """Warn where one of a model's first ``CHECKED_CALLS`` eager calls (``calls_before`` ran before it)
    gave NaN in its main output."""
    if calls_before >= CHECKED_CALLS:
        return
    tensor = main_output(output)
    # amax carries NaN through without a mask the size of the logits (``isnan`` would make one)
    if tensor is None or not tensor.numel() or not bool(tensor.amax().isnan()):
        return
    warnings.warn(
        NaNOutputWarning(
            f"an eager call of the offloaded {model_name} gave NaN. fxoffload_hf lends each module its "
            "weights for its own call (and those of the children its code reads); a weight read any other "
            "way reads a stand-in whose values are NaN. If the model gives no NaN without offloading, pass "
            'capture="first-call" (a captured graph is given every weight it reads) and report the model '
            "type; if it does, this is the model's own"
        ),
        stacklevel=3,
    )
