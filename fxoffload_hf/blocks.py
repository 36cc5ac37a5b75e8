"""Repeated blocks: trace one, stamp out the rest.

A transformer repeats one block class N times, and dynamo traces every call of it anew, so capture costs
grow with depth. A block marked as a nested compile region (``torch.compiler.nested_compile_region``) is
traced once: dynamo stamps out the traced subgraph for the other blocks, each with its own weights. The
engine asks dynamo to inline the regions back (``inline_invoke_subgraph``), so the graph it partitions
is flat and holds the same ops as without them: pieces may still end inside a block.

Only calls without state go through the region. A block that writes a KV cache has a side effect dynamo
cannot stamp out; it would trace each block anyway, at a higher cost than plain, so such calls (any
argument that is not a tensor, a number, a string or None, e.g. a ``Cache``) call the block as usual.
Where dynamo cannot capture a region at all (an op it must run eagerly inside the block, outputs that
alias inputs), ``BlockRegions.give_up`` turns them off for the model and the call is captured plain.
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fxoffload_hf.undo import PatchedAttribute, Undo

# Distinct traces dynamo keeps per block class (prefill, decode-free forwards at several batch forms):
# past it dynamo raises, so the limit is well above what a model's call patterns produce.
_REUSE_ENTRIES = 256
_PLAIN = (torch.Tensor, int, float, bool, str, torch.dtype, torch.device, type(None))
# Dynamo inlines nested regions back into a flat graph from torch 2.12 on; before it, blocks are traced plain.
SUPPORTED = hasattr(torch._dynamo.config, "inline_invoke_subgraph")


class BlockRegions:
    """The repeated blocks of one model, marked as nested compile regions while ``enabled``."""

    def __init__(self) -> None:
        self.enabled = SUPPORTED
        self.blocks: list[nn.Module] = []

    def give_up(self) -> bool:
        """Stop routing calls through the regions; whether they were in use (a retry can help)."""
        was, self.enabled = self.enabled and bool(self.blocks), False
        return was

    def mark(self, model: nn.Module) -> list[Undo]:
        """Route the repeated blocks of ``model`` through one region per block class; the undo records."""
        undo: list[Undo] = []
        if not SUPPORTED:
            return undo
        forwards: dict[Callable[..., Any], Callable[..., Any]] = {}
        for block in repeated_blocks(model):
            plain = type(block).forward
            if plain not in forwards:
                forwards[plain] = self._dispatch(plain)
            had = "forward" in block.__dict__
            undo.append(PatchedAttribute(block, "forward", had, block.__dict__.get("forward")))
            block.forward = types.MethodType(forwards[plain], block)  # type: ignore[method-assign]
            self.blocks.append(block)
        if self.blocks:
            undo.extend(_stateless_kernel_dispatch(model))
        return undo

    def _dispatch(self, plain: Callable[..., Any]) -> Callable[..., Any]:
        def region(module: nn.Module, *stream: Any) -> Any:
            args, kwargs = _unflatten(stream)
            return plain(module, *args, **kwargs)

        marked = torch.compiler.nested_compile_region(region, max_reuse_entries=_REUSE_ENTRIES)

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.enabled and torch.compiler.is_dynamo_compiling() and stateless(args, kwargs):
                stream = _flatten(args, kwargs)
                if stream is not None:
                    return marked(module, *stream)
            return plain(module, *args, **kwargs)

        return forward


# A region called with flat positional leaves only (tensors, numbers, strings, None) takes dynamo's fast
# path when it checks whether a trace can be reused; keywords or tuples make it flatten them with pytree
# for every block, a quarter of planning's time. The call goes in as a stream: the argument count, each
# argument as -1 and a leaf or as a tuple's length and its leaves, then the keywords likewise behind
# their names.
def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any] | None:
    """The call as a flat stream of leaves, or None when a value nests deeper than one tuple."""
    stream: list[Any] = [len(args)]
    for name, value in [*((None, a) for a in args), *kwargs.items()]:
        if name is not None:
            stream.append(name)
        if isinstance(value, tuple):
            if any(isinstance(v, (tuple, list)) for v in value):
                return None
            stream += [len(value), *value]
        elif isinstance(value, list):
            return None
        else:
            stream += [-1, value]
    return stream


def _unflatten(stream: tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    """The arguments and keywords ``_flatten`` made ``stream`` of."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional, i = stream[0], 1
    while i < len(stream):
        name = None
        if len(args) == positional:
            name, i = stream[i], i + 1
        count, i = stream[i], i + 1
        value = stream[i] if count < 0 else tuple(stream[i : i + count])
        i += 1 if count < 0 else count
        if name is None:
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


class _NoKernelFunctions:
    """A stand-in for the ``kernels`` package's registry of active kernel functions that holds nothing."""

    def get(self) -> None:
        return None

    def set(self, value: object) -> None:
        return None

    def reset(self, token: object) -> None:
        return None


def _stateless_kernel_dispatch(model: nn.Module) -> list[Undo]:
    """With the ``kernels`` package installed, Transformers (5.25 on) wraps attention forwards in a
    dispatcher that, under compile, writes a module global on every call and restores it after: a side
    effect, so dynamo would trace every block anew. While none of the model's kernel functions has been
    kernelized, that dispatch always ends in the plain function; a registry that holds nothing gives the
    same ops without the write."""
    registry_module = sys.modules.get("kernels._internals.layer.layer")
    registry = getattr(registry_module, "_ACTIVE_KERNEL_FUNCS", None)
    if registry is None or isinstance(registry, _NoKernelFunctions):
        return []  # no kernels package, or another plan holds the stand-in already
    for module in model.modules():
        for function in module.__dict__.get("_kernel_funcs", {}).values():
            if getattr(function.forward, "__func__", None) is not type(function).forward:
                return []  # a kernelized function: its dispatch must stay
    registry_module._ACTIVE_KERNEL_FUNCS = _NoKernelFunctions()  # type: ignore[union-attr]
    return [PatchedAttribute(registry_module, "_ACTIVE_KERNEL_FUNCS", True, registry)]


def repeated_blocks(model: nn.Module) -> Iterator[nn.Module]:
    """Children of a ``ModuleList`` or ``Sequential`` that share their class and parameter shapes with at
    least one sibling and have no other forward set on the instance. Only blocks (modules made
    of modules, holding weights) count: a list of single layers gains nothing from being stamped out."""
    for container in model.modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        alike: dict[tuple[Any, ...], list[nn.Module]] = defaultdict(list)
        for child in container:
            if not _has_own_forward(child) and _is_block(child):
                alike[_signature(child)].append(child)
        for group in alike.values():
            if len(group) > 1:
                yield from group


def block_kinds(blocks: Iterable[nn.Module]) -> list[tuple[Any, ...]] | None:
    """The kind of each of ``blocks`` (blocks of one kind have the same class, parameter shapes and
    flags), or None where one is not a block or has a forward of its own."""
    children = list(blocks)
    if not children or not all(_is_block(c) and not _has_own_forward(c) for c in children):
        return None
    return [_signature(c) for c in children]


def _has_own_forward(module: nn.Module) -> bool:
    """A forward set on the instance other than its class's own bound to it (accelerate's hooks leave
    that behind when they are removed, as after Transformers' loading)."""
    own = module.__dict__.get("forward")
    return own is not None and getattr(own, "__func__", None) is not type(module).forward


def _is_block(module: nn.Module) -> bool:
    return any(True for _ in module.children()) and any(True for _ in module.parameters())


# attributes that tell blocks apart without changing what a call without state computes
_POSITION_ATTRS = frozenset({"layer_idx", "layer_id", "layer_number", "block_idx", "idx", "training"})


def _signature(block: nn.Module) -> tuple[Any, ...]:
    """Class, parameter shapes, and every plain attribute of the block's modules but its position: blocks
    of one class that differ in a flag (local or global attention, a layer type) are not alike. Dynamo
    would check such flags before it reuses a trace; grouping by them does not rely on that check."""
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())
    flags = tuple(
        (name, attr, value)
        for name, module in block.named_modules()
        for attr, value in sorted(vars(module).items())
        if attr not in _POSITION_ATTRS
        and not attr.startswith("_")
        and isinstance(value, (bool, int, float, str))
    )
    return (type(block), params, flags)


def stateless(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call passes only tensors, numbers, strings and None (in tuples and lists at most)."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        value = stack.pop()
        if isinstance(value, (tuple, list)):
            stack.extend(value)
        elif not isinstance(value, _PLAIN):
            return False
    return True


def region_counts() -> tuple[int, int]:
    """Blocks dynamo traced as regions, and blocks it stamped out from an earlier trace, since its last
    reset (from dynamo's compile-time records)."""
    from torch._dynamo.utils import compilation_time_metrics

    return (
        len(compilation_time_metrics.get("invoke_subgraph_trace", [])),
        len(compilation_time_metrics.get("invoke_subgraph_reuse_stamp_out", [])),
    )
