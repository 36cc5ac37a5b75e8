"""Transformers' eager algorithms inside an offloaded model's calls, where compiling would pick another.

Transformers asks ``is_torchdynamo_compiling()`` to choose code that traces well. Where the two choices
round differently, the graph dynamo captures is not bit-exact against eager. In each module named in
``_MODULES`` that function is replaced, while any model is offloaded, by one that answers False while an
offloaded model's entry point runs (``inside``) and asks Transformers' own otherwise. Dynamo guards on
that answer, so the graphs of an offloaded model take the eager code, and other compiled code in the
process keeps its own graphs.

- ``transformers.integrations.sdpa_attention``: for one query token with a mask and grouped key/value
  heads (batched decoding with padding), eager packs the query heads onto the key/value heads
  (``pack_gqa``) where compiled code repeats the key/value heads (``repeat_kv``): another SDPA shape,
  other rounding. The packed form traces as well here: a length of 1 is specialised by dynamo anyway.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_MODULES = ("transformers.integrations.sdpa_attention",)
_ASK = "is_torchdynamo_compiling"

# True while an offloaded model's entry point runs; read (and guarded on) by the replacements
_inside = False
_lock = threading.Lock()
_users = 0
_originals: dict[str, Callable[[], bool]] = {}  # module name -> Transformers' function


@contextmanager
def inside() -> Iterator[None]:
    """An offloaded model's call: the replaced functions answer False (the eager code) within it."""
    global _inside
    was, _inside = _inside, True
    try:
        yield
    finally:
        _inside = was


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


def _replace() -> None:
    for name in _MODULES:
        if name in _originals:
            continue
        module = sys.modules.get(name)  # not imported: no model of it in this process, nothing to do
        original = getattr(module, _ASK, None)
        if module is not None and callable(original):
            _originals[name] = original
            setattr(module, _ASK, _eager_inside(original))


def _put_back() -> None:
    for name, original in _originals.items():
        module = sys.modules.get(name)
        if module is not None:
            setattr(module, _ASK, original)
    _originals.clear()


def _eager_inside(original: Callable[[], bool]) -> Callable[[], bool]:
    def is_torchdynamo_compiling() -> bool:
        return not _inside and original()

    return is_torchdynamo_compiling
