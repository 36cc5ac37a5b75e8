"""The plan of a model without running it: capture on the meta device, partition, report.

Shapes propagate through meta tensors, so nothing is allocated and no real compute runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from fxoffload_hf.config import BudgetSpec, OffloadConfig
from fxoffload_hf.graphs import activation_peak
from fxoffload_hf.memory_model import (
    BudgetTooSmallError,
    MemoryModel,
    cuts_for,
    format_bytes,
    nbytes,
    piece_bytes,
    window_bytes,
)
from fxoffload_hf.planner import partition_for_budget


@dataclass
class PlanReport:
    """What the engine would do with a model at given budgets, batch and sequence length."""

    model: str
    weight_bytes: int
    resident_small_bytes: int
    activation_bytes: int
    budget_name: str
    budget: int | None
    pieces: list[int]
    arena_bytes: int
    resident_bytes_max: int
    smallest_budget: int
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        lines = [
            f"model              {self.model}",
            f"weights            {format_bytes(self.weight_bytes)}",
            f"small resident     {format_bytes(self.resident_small_bytes)} (buffers and small parameters)",
            f"activation peak    {format_bytes(self.activation_bytes)} (estimated)",
            f"budget             {self.budget_name}={format_bytes(self.budget)}",
            f"smallest budget    {format_bytes(self.smallest_budget)}",
        ]
        if self.error:
            lines.append(f"cannot run         {self.error}")
            return "\n".join(lines)
        lines += [
            f"pieces             {len(self.pieces)} (weights per piece {format_bytes(min(self.pieces))} .. "
            f"{format_bytes(max(self.pieces))})",
            f"staging arena      {format_bytes(self.arena_bytes)} (two consecutive pieces in flight, or one too large to pair)",
            f"resident at most   {format_bytes(self.resident_bytes_max)} (kept in memory, the rest streams)",
        ]
        return "\n".join(lines)


def capture_on_meta(model: torch.nn.Module, *inputs: Any) -> tuple[fx.GraphModule, list[Any]]:
    """Capture ``model.forward`` once with meta inputs; the graph and its example inputs."""
    captured: list[tuple[fx.GraphModule, list[Any]]] = []

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        captured.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend, fullgraph=False)
    with torch.no_grad():
        compiled(*inputs, use_cache=False)
    torch._dynamo.reset()
    return max(captured, key=lambda c: len(c[0].graph.nodes))


def plan_checkpoint(
    folder: str | Path,
    *,
    gpu_memory: BudgetSpec = None,
    cpu_memory: BudgetSpec = None,
    device: str | None = "cpu",
    batch: int = 1,
    seq_len: int = 128,
) -> PlanReport:
    """Plan the model of a checkpoint folder (only its config.json is read)."""
    import transformers as tf

    from fxoffload_hf.integrations.transformers import resolve_checkpoint_folder

    config = tf.AutoConfig.from_pretrained(resolve_checkpoint_folder(folder))
    return plan_config(
        config, gpu_memory=gpu_memory, cpu_memory=cpu_memory, device=device, batch=batch, seq_len=seq_len
    )


def plan_config(
    config: Any,
    *,
    gpu_memory: BudgetSpec = None,
    cpu_memory: BudgetSpec = None,
    device: str | None = "cpu",
    batch: int = 1,
    seq_len: int = 128,
) -> PlanReport:
    """Plan a transformers config built on the meta device, for a forward of ``batch`` x ``seq_len``."""
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config).eval()
    settings = OffloadConfig.build(gpu_memory=gpu_memory, cpu_memory=cpu_memory, device=device)
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    gm, example_inputs = capture_on_meta(model, ids)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    weights: dict[fx.Node, int] = {}
    small = 0
    for node, value in zip(placeholders, example_inputs, strict=False):
        if not isinstance(value, torch.Tensor):
            continue
        size = nbytes(value.shape, value.element_size())
        if isinstance(value, torch.nn.Parameter) and size >= settings.resident_threshold:
            weights[node] = size
        else:
            small += size
    activations = activation_peak(gm.graph, set(weights))
    memory = MemoryModel.where_it_computes(
        settings.device.type, settings.gpu_memory, settings.cpu_memory, small
    )
    report = PlanReport(
        model=type(model).__name__,
        weight_bytes=sum(weights.values()),
        resident_small_bytes=small,
        activation_bytes=activations,
        budget_name=memory.budget_name,
        budget=memory.budget,
        pieces=[],
        arena_bytes=0,
        resident_bytes_max=0,
        smallest_budget=memory.smallest_budget(max(weights.values(), default=0), activations),
    )
    try:
        partition = partition_for_budget(gm.graph, weights, activations, memory, settings.policy)
    except BudgetTooSmallError as exc:
        report.error = str(exc)
        report.smallest_budget = exc.smallest_budget
        return report
    report.pieces = [p.weight_bytes for p in partition.pieces]
    sizes = [piece_bytes(weights[w] for w in p.weights) for p in partition.pieces]
    room = memory.room(activations)
    report.arena_bytes = window_bytes(sizes, 2, cuts_for(sizes, room))  # a piece too large to pair runs alone
    report.resident_bytes_max = report.weight_bytes if room is None else max(room - report.arena_bytes, 0)
    return report
