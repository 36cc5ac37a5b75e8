"""What ``plan`` reports: the sizes, the smallest budgets and what sets them, the pieces at the budget
given, and decode speed by budget; as a table (``fxoffload-hf plan``) or a dict (``--json``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fxoffload_hf.memory_model import format_bytes
from fxoffload_hf.tradeoff import Estimate


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
    floor_set_by: str = ""
    device: str = "cpu"
    blocks_traced: int = 0  # repeated blocks traced by dynamo, and those stamped out from that trace
    blocks_reused: int = 0
    kv_cache_bytes: int = 0  # generate's cache at batch x seq_len (full attention)
    # host memory generate's two captured graphs hold (CPU budgets; on a GPU, charged to cpu_memory)
    graph_state_bytes: int = 0
    eager_budget: int | None = None  # the smallest budget of eager calls (None: they cannot be bounded)
    eager_set_by: str = ""
    tradeoff: list[Estimate] = field(default_factory=list)
    error: str | None = None
    # the activation peak where weights converted before their projections stream in tiles (``projections``)
    tiled_activation_bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tradeoff"] = [asdict(e) | {"tokens_per_second": e.tokens_per_second} for e in self.tradeoff]
        return out

    def table(self) -> str:
        graphs: list[str] = []  # shown where counted: CPU plans, and GPU plans given cpu_memory
        if self.graph_state_bytes:
            where = ", charged to cpu_memory" if self.device == "cuda" else ""
            graphs.append(
                f"captured graphs    {format_bytes(self.graph_state_bytes)} (dynamo's state of generate's "
                f"two graphs, in host memory{where})"
            )
        lines = [
            f"model              {self.model}",
            f"weights            {format_bytes(self.weight_bytes)}",
            f"small resident     {format_bytes(self.resident_small_bytes)} (buffers and small parameters)",
            f"activation peak    {format_bytes(self.activation_bytes)} (estimated, one forward{self._tiled()})",
            f"KV cache           {format_bytes(self.kv_cache_bytes)} (generate up to that length; a decode "
            "step holds two)",
            *graphs,
            f"budget             {self.budget_name}={format_bytes(self.budget)}",
            f"smallest budget    {format_bytes(self.smallest_budget)} (captured and streamed; set by "
            f"{self.floor_set_by})",
            self._eager_line(),
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
        return "\n".join(lines + self._tradeoff_lines())

    def _tiled(self) -> str:
        if self.tiled_activation_bytes is None or self.tiled_activation_bytes == self.activation_bytes:
            return ""
        return (
            f"; {format_bytes(self.tiled_activation_bytes)} with the weights converted to another dtype "
            "before their projections in tiles, each converting its own rows"
        )

    def _eager_line(self) -> str:
        if self.eager_budget is None:
            return f"eager calls        not bounded: {self.eager_set_by}"
        return (
            f'eager calls from   {format_bytes(self.eager_budget)} (the default, capture="deferred", runs calls '
            f"eagerly from this budget on, until capture is worth its cost; set by {self.eager_set_by})"
        )

    def _tradeoff_lines(self) -> list[str]:
        if not self.tradeoff:
            return []
        lines = [
            "",
            f"decode speed by {self.budget_name} on {self.device} (predicted from sizes and assumed bandwidths)",
            f"{'budget':>12} {'resident':>12} {'from host':>12} {'from disk':>12} {'tokens/s':>10}",
        ]
        for e in self.tradeoff:
            lines.append(
                f"{format_bytes(e.budget):>12} {format_bytes(e.resident):>12} {format_bytes(e.from_host):>12} "
                f"{format_bytes(e.from_disk):>12} {e.tokens_per_second:>10.2f}"
            )
        return lines
