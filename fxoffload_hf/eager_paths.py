"""Transformers' eager algorithms inside an offloaded model's calls, where compiling would pick another.

Transformers asks ``is_torchdynamo_compiling()`` (and ``is_torchdynamo_exporting()``) to choose code that
traces well. Where the two choices round differently, the graph dynamo captures is not bit-exact against
eager. Each function named in ``_EAGER_INSIDE`` is replaced, while any model is offloaded, by one that
answers False while an offloaded model's entry point runs (``inside``) and asks Transformers' own
otherwise. Dynamo guards on that answer, so the graphs of an offloaded model take the eager code, and
other compiled code in the process keeps its own graphs.

- ``sdpa_attention.is_torchdynamo_compiling``: for one query token with a mask and grouped key/value
  heads (batched decoding with padding), eager packs the query heads onto the key/value heads
  (``pack_gqa``) where compiled code repeats the key/value heads (``repeat_kv``): another SDPA shape,
  other rounding. The packed form traces as well here: a length of 1 is specialised by dynamo anyway.
- ``masking_utils.is_torchdynamo_exporting``: before torch 2.14 dynamo traces ``torch.compiler.
  is_exporting()`` as True, so compiled code always builds an explicit causal mask where eager passes
  none and sets SDPA's ``is_causal``. On an H200 that picks the same cuDNN kernel with other rounding
  (a bf16 Llama with head size 128: logits one ulp off, greedy tokens parted from eager's). An offloaded
  call never exports.

- ``moe._can_use_grouped_mm``: Transformers computes a mixture of experts with torch's grouped product
  where it can, and traces its own fallback (one product per expert, an op of its own) only for
  non-bf16 weights. Tracing torch's product checks the weight's strides, which an offloaded weight's
  ghost (one value broadcast) does not have: a bf16 model's capture failed. Inside a traced call of an
  offloaded model it answers False, so the graph holds the fallback, which computes the same per-expert
  products as torch's grouped product on the CPU, bit for bit (``tests/test_expert_tiles.py``); on CUDA
  cuBLAS' grouped kernel may round otherwise (``tests/test_gpu.py`` checks tokens and closeness; no GPU
  has run it yet). Eager calls still take torch's.

On CUDA, ``masking_utils`` also decides from a traced mask's values whether SDPA needs a mask at all:
eager passes none where the padding mask is all ones, compiled code always passes one. There its
``is_tracing(tensor)`` answers False inside an offloaded call, so the values are read as eager reads
them: dynamo breaks the graph at that test and resumes after it. On the CPU both ways give the same bits,
and the graph stays whole.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

_EAGER_INSIDE = (
    ("transformers.integrations.sdpa_attention", "is_torchdynamo_compiling"),
    ("transformers.masking_utils", "is_torchdynamo_exporting"),
)
_MASKS_BY_VALUE = ("transformers.masking_utils", "is_tracing")
_GROUPED_EXPERTS = ("transformers.integrations.moe", "_can_use_grouped_mm")

# True while an offloaded model's entry point runs; read (and guarded on) by the replacements
_inside = False
_masks_by_value = False  # while inside: masks are tested by their values, as eager tests them (CUDA)
_lock = threading.Lock()
_users = 0
# (module, function name) -> what was there before (Transformers' own, or a patch), and our replacement
_replaced: dict[tuple[str, str], tuple[Callable[..., bool], Callable[..., bool]]] = {}


@contextmanager
def inside(masks_by_value: bool = False) -> Iterator[None]:
    """An offloaded model's call: the replaced functions answer False (the eager code) within it;
    ``masks_by_value``: also for masks (``masking_utils``)."""
    global _inside, _masks_by_value
    was = _inside, _masks_by_value
    _inside, _masks_by_value = True, masks_by_value
    try:
        yield
    finally:
        _inside, _masks_by_value = was


class EagerPaths:
    """The replacements in place while this model is offloaded (an undo record of ``offload``);
    shared by every offloaded model, put back when the last is restored."""

    def __init__(self) -> None:
        global _users
        with _lock:
            _replace()
            _users += 1

    def undo(self) -> None:
        global _users
        with _lock:
            _users -= 1
            if _users == 0:
                _put_back()


def _replacements() -> Iterator[tuple[str, str, Callable[[Callable[..., bool]], Callable[..., bool]]]]:
    for name, attr in _EAGER_INSIDE:
        yield name, attr, _eager_inside
    yield *_MASKS_BY_VALUE, _masks_read_inside
    yield *_GROUPED_EXPERTS, _experts_traced_by_fallback


def _replace() -> None:
    """Put each replacement in place, where it is not: also where something else was put there since
    (a test's or another library's patch, which the replacement then asks in turn)."""
    for name, attr, replacement in _replacements():
        module = sys.modules.get(name)  # not imported: no model of it in this process, nothing to do
        current, placed = getattr(module, attr, None), _replaced.get((name, attr))
        if module is None or not callable(current) or (placed is not None and current is placed[1]):
            continue
        ours = replacement(current)
        _replaced[name, attr] = (current, ours)
        setattr(module, attr, ours)


def _put_back() -> None:
    """Put back what each replacement replaced, where it is still in place (a patch put there since
    stays)."""
    for (name, attr), (original, ours) in _replaced.items():
        module = sys.modules.get(name)
        if module is not None and getattr(module, attr, None) is ours:
            setattr(module, attr, original)
    _replaced.clear()


def _eager_inside(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def answer_for_eager() -> bool:
        return not _inside and original()

    return answer_for_eager


def _masks_read_inside(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_tracing(tensor: Any = None) -> bool:
        if tensor is not None and _inside and _masks_by_value:
            return False
        return original(tensor)

    return is_tracing


def _experts_traced_by_fallback(original: Callable[..., bool]) -> Callable[..., bool]:
    @functools.wraps(original)
    def can_use_grouped_mm(input: Any, weight: Any, offs: Any) -> bool:
        if _inside and torch.compiler.is_compiling():
            return False
        return original(input, weight, offs)

    return can_use_grouped_mm
