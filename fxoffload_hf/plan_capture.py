"""The graph ``plan`` partitions: a model captured once on the meta device, with its weights' names.

Shapes propagate through meta tensors, so nothing is allocated and no real compute runs. Where the
decoder layers repeat a few kinds, the model built with its first few layers is captured and its graph
deepened (``plan_depth``); elsewhere the whole model is captured, its repeated blocks stamped out
(``blocks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxoffload_hf import plan_depth
from fxoffload_hf.blocks import BlockRegions, region_counts
from fxoffload_hf.capture import compile_entry


@dataclass(frozen=True)
class MetaCapture:
    graph: fx.GraphModule
    example_inputs: list[Any]
    blocks_traced: int  # repeated blocks dynamo traced, and those it stamped out from a trace
    blocks_reused: int


def capture_on_meta(model: torch.nn.Module, *inputs: Any, stamp_blocks: bool = True) -> MetaCapture:
    """Capture ``model.forward`` once with meta inputs: the largest graph and its example inputs.

    Repeated blocks are traced once (``blocks``) unless ``stamp_blocks`` is False.
    """
    captured: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, list(example_inputs)))
        return gm.forward

    regions = BlockRegions()
    undo = regions.mark(model) if stamp_blocks else []
    torch._dynamo.reset()
    try:
        compiled = compile_entry(model.forward, backend, regions, dynamic=False)
        with torch.no_grad():
            try:
                compiled(*inputs, use_cache=False)
            except Exception:
                # a stamped-out block that does not fit its call (dynamo's reuse check is not airtight):
                # meta tensors have no side effects, so capture again without the regions
                if not regions.give_up():
                    raise
                captured.clear()
                torch._dynamo.reset()
                compiled(*inputs, use_cache=False)
        traced, reused = region_counts()
    finally:
        torch._dynamo.reset()
        for record in reversed(undo):
            record.undo()
    gm, example_inputs = max(captured, key=lambda c: len(c[0].graph.nodes))
    return MetaCapture(gm, example_inputs, traced, reused)


def deep(model: torch.nn.Module, ids: torch.Tensor) -> tuple[MetaCapture, dict[int, str]]:
    """``model`` captured whole (repeated blocks stamped out by dynamo), and its weights' names."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return capture_on_meta(model, ids), names


def shallow(
    config: Any, model: torch.nn.Module, ids: torch.Tensor
) -> tuple[MetaCapture, dict[int, str]] | None:
    """Where ``model``'s decoder layers repeat a few kinds: the model built with its first few layers
    (after the first, every kind of the layers after them), captured, and its graph deepened to
    ``model``'s depth (``plan_depth``); None where that does not apply."""
    import transformers as tf

    layers = plan_depth.repeated_layers(model)
    shallow = plan_depth.shallow_config(config, layers.traced) if layers else None
    if layers is None or shallow is None:
        return None
    try:
        with torch.device("meta"):
            small = tf.AutoModelForCausalLM.from_config(shallow).eval()
        if not plan_depth.is_prefix(small.get_submodule(layers.path), layers):
            return None
        tensors = [
            *small.named_parameters(remove_duplicate=False),
            *small.named_buffers(remove_duplicate=False),
        ]
        names = {id(t): n for n, t in tensors}
        capture = capture_on_meta(small, ids, stamp_blocks=False)
        inputs = plan_depth.deepen(capture.graph, capture.example_inputs, names, layers)
    except Exception:  # noqa: BLE001 - a config that does not shrink, a graph not deepened: capture it all
        return None
    if inputs is None:
        return None
    return MetaCapture(capture.graph, inputs, layers.traced, layers.depth - layers.traced), names
