"""Children whose weights a module reads without calling them, which its eager call must be lent too.

A module's forward hooks lend its own weights (``eager_fallback``); a child's lend when the child is
called. Some modules read a child's weight without calling it: Transformers' Mamba mixers compute
``self.dt_proj.weight @ x`` and hand ``self.conv1d`` to a kernel's fallback that reads its weight. Run
eagerly, such a read would see the child's ghost (NaN) wherever the weight is offloaded rather than kept
resident (wide enough models). Two signs name those children:

- Transformers' own declaration, ``@force_accelerate_hooks("conv1d", ...)`` on the forward, which makes
  accelerate's offload hooks fire for those children around the parent's call;
- the module's own code reading ``self.<child>.<parameter>`` in any method its class defines (a
  captured graph reads these too, where the engine feeds them; only eager calls need them lent).

A child the module also calls is lent its weights by its own call; but a call may take a path that reads
it instead (RecurrentGemma's recurrent block calls ``conv_1d`` on a prompt and reads its weight at each
decode step). Such a child is lent to the module too where its parameters are small
(``SMALL_READ_BYTES``): what it costs the module's calls is small, where lending a whole embedding table or
output projection read in a rarely taken path (Gemma 4's, xLSTM's, the Mamba mixers' training kernels)
to every call would not be.
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Iterator
from types import CodeType, FunctionType
from typing import Any

from torch import nn

_LOADS_OF_SELF = {"LOAD_FAST", "LOAD_DEREF"}  # a method's argument, or a nested function's closure
_ATTRIBUTE_LOADS = {"LOAD_ATTR", "LOAD_METHOD"}
# what a ghost tells as it is (its values are never read for these)
_METADATA = {"dtype", "device", "shape", "size", "ndim", "dim", "is_cuda", "requires_grad", "numel"}
_NOT_STEPS = {"CACHE", "PRECALL", "EXTENDED_ARG"}  # bytecode between the loads of ``self.a.b`` (3.11)
# a child the module also calls is lent with it where its own parameters take at most this
SMALL_READ_BYTES = 1 << 20


def children_read_directly(module: nn.Module) -> list[nn.Module]:
    """The children of ``module`` whose parameters its own code reads without calling them (see the
    module docstring), in the order of ``named_children``: those Transformers names to
    ``force_accelerate_hooks``, and those the class's code reads as ``self.<child>.<parameter>`` and never
    uses otherwise, or reads only small parameters of (a child it calls is lent its weights by its own
    call, where the call takes that path)."""
    children = dict(module.named_children())
    if not children:
        return []
    known = _CLASS_READS.get(type(module))
    if known is None:
        known = _CLASS_READS[type(module)] = _class_reads(type(module))
    forced, reads, uses = known
    read: set[str] = set()
    used = set(uses)  # an attribute other than a parameter (a method, ``kernel_size``) counts as a use
    for child, attribute in reads:
        parameters = getattr(children.get(child), "_parameters", {})
        (read if attribute in parameters else used).add(child)
    # a child it also calls is lent whole, all its own parameters: where those are small
    small = {c for c in read & used if _own_bytes(children[c]) <= SMALL_READ_BYTES}
    named = set(forced) | (read - used) | small
    return [child for name, child in children.items() if name in named]


def _own_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module._parameters.values() if p is not None)


_Reads = tuple[tuple[str, ...], frozenset[tuple[str, str]], frozenset[str]]
_CLASS_READS: dict[type, _Reads] = {}  # by module class: a model repeats its classes


def _class_reads(cls: type) -> _Reads:
    """For a module class: the children its forward names to ``force_accelerate_hooks``, every
    ``self.a.b`` its code reads, and every ``a`` of a ``self.a`` it uses otherwise (a call, an argument)."""
    reads: set[tuple[str, str]] = set()
    uses: set[str] = set()
    for code, self_name in _class_code(cls):
        for child, attribute in _uses_of_children(code, self_name):
            if attribute is None:
                uses.add(child)
            else:
                reads.add((child, attribute))
    return tuple(_forced_children(getattr(cls, "forward", None))), frozenset(reads), frozenset(uses)


def _forced_children(forward: Any) -> list[str]:
    """The children named to Transformers' ``force_accelerate_hooks`` anywhere in ``forward``'s chain of
    decorators (each keeps the next as ``__wrapped__``)."""
    wrapper = _forcing_wrapper_code()
    if wrapper is None:
        return []
    freevars = wrapper.co_freevars
    names: list[str] = []
    for _ in range(16):  # a chain of decorators, never a cycle in practice
        if not callable(forward):
            break
        closure = getattr(forward, "__closure__", None)
        if getattr(forward, "__code__", None) is wrapper and closure is not None:
            listed = dict(zip(freevars, closure, strict=True))["child_module_names"].cell_contents
            names.extend([listed] if isinstance(listed, str) else list(listed))
        forward = getattr(forward, "__wrapped__", None)
    return names


@functools.cache
def _forcing_wrapper_code() -> CodeType | None:
    """The code of the wrapper ``force_accelerate_hooks`` puts around a forward (one code object for every
    use); None where this Transformers has no such decorator."""
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except ImportError:
        return None
    sample = force_accelerate_hooks("child")(lambda self: None)
    return getattr(sample, "__code__", None)


def _class_code(cls: type) -> Iterator[tuple[CodeType, str]]:
    """The code of every function ``cls`` and its bases up to torch's define, with what each nests
    (comprehensions, local functions, which reach ``self`` through a closure), each decorated function's
    innermost code included; each with the name its method calls ``self``."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("torch.") or klass is object:
            break
        for value in vars(klass).values():
            function = value
            while isinstance(function, FunctionType):
                code = function.__code__
                self_name = code.co_varnames[0] if code.co_argcount else "self"
                yield from ((nested, self_name) for nested in _nested(code))
                function = getattr(function, "__wrapped__", None)


def _nested(code: CodeType) -> Iterator[CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, CodeType):
            yield from _nested(constant)


def _uses_of_children(code: CodeType, self_name: str) -> Iterator[tuple[str, str | None]]:
    """``(a, b)`` for every ``self.a.b`` the code reads, ``(a, None)`` for every other use of ``self.a``
    (a call, an argument), ``self`` being ``self_name``. Attributes that are no child are filtered by the
    caller."""
    instructions = [i for i in dis.get_instructions(code) if i.opname not in _NOT_STEPS]
    for at, first in enumerate(instructions[:-1]):
        second = instructions[at + 1]
        if (
            first.opname not in _LOADS_OF_SELF
            or first.argval != self_name
            or second.opname not in _ATTRIBUTE_LOADS
        ):
            continue
        third = instructions[at + 2] if at + 2 < len(instructions) else None
        if third is None or third.opname not in _ATTRIBUTE_LOADS:
            yield str(second.argval), None
            continue
        fourth = instructions[at + 3] if at + 3 < len(instructions) else None
        if fourth is None or fourth.opname not in _ATTRIBUTE_LOADS or fourth.argval not in _METADATA:
            yield str(second.argval), str(third.argval)  # ``self.a.b.dtype`` reads no value
