"""Whether capturing a call like the recent eager ones could fit the budget at all, told before anything
is traced: a captured graph holds host memory in proportion to its nodes
(``memory_model.graph_state_bytes``), and has at least ``_GRAPH_NODES_PER_OP`` nodes per torch operation
its eager call ran (``eager_ops``). A capture the budget then refuses would have cost its tracing and
left host memory behind; counting costs each operation a Python call, so only some eager calls count.
"""

from __future__ import annotations

from fxoffload_hf.memory_model import MemoryModel

# A captured graph's nodes per torch operation its eager call ran, at least (``eager_ops``; measured on
# twelve architectures, dense, mixtures of experts and Mamba, prefill and decode: 0.80 to 1.04): below
# it, a capture's state is not overestimated, so no capture that could fit is skipped.
_GRAPH_NODES_PER_OP = 0.75
# Eager calls count their operations in the first few calls, then in one call of so many: a kind of
# call keeps its graph's size, and counting costs each operation about 2 us (a Python call per operation,
# several percent of a decode step whose weights are cached).
_COUNTED_FIRST = 4
_COUNTED_EVERY = 16


class CaptureForecast:
    """What the operations of one model's recent eager calls tell of capturing a call like them."""

    def __init__(self, counts_graph_state: bool) -> None:
        # the budget counts captured graphs' state (``CaptureBudget.in_budget``): only then can a capture
        # be seen not to fit
        self.counts_graph_state = counts_graph_state
        self.recent_ops: tuple[int, ...] = ()  # the operations of the last two eager calls counted
        self.calls_counted = 0

    def predicts(self, memory: MemoryModel) -> bool:
        """Whether a capture may be seen not to fit ``memory``'s budget before it is traced: where the
        budget counts graphs' state; eager calls count their operations only then."""
        return self.counts_graph_state and memory.budget is not None

    def counts(self, memory: MemoryModel, eager_calls: int) -> bool:
        """Whether the next eager call (``eager_calls`` ran before it) counts its operations: where
        captures are predicted, the first ``_COUNTED_FIRST`` calls, then one in ``_COUNTED_EVERY``."""
        if not self.predicts(memory):
            return False
        return self.calls_counted < _COUNTED_FIRST or eager_calls % _COUNTED_EVERY == 0

    def counted(self, ops: int) -> None:
        """An eager call ran ``ops`` torch operations."""
        self.recent_ops = (*self.recent_ops[-1:], ops)
        self.calls_counted += 1

    def least_to_capture(
        self, memory: MemoryModel, *, expected: int = 0, transient: bool = True
    ) -> int | None:
        """Where capturing a call like the recent eager ones surely needs more than ``memory``'s budget,
        the least it would need: its graph's state beside what is counted now and ``expected`` bytes of
        a generate's KV caches (a captured call's activations are at least those), with no weights; with
        ``transient``, also the capture's transient as large as the state (as the engine counts it for
        one graph: a call dynamo splits into several holds each graph's in turn, so only the bound without
        it is sure for every call). None where it may fit, or nothing tells (the budget does not count
        graphs' state, no call was counted)."""
        budget = memory.budget
        if not self.predicts(memory) or budget is None or not self.recent_ops:
            return None
        captured = memory.with_graph(self.predicted_nodes())
        if not transient:
            captured = captured.with_capture_reserve(0)
        least = captured.need(activations=expected)
        return least if least > budget else None

    def predicted_nodes(self) -> int:
        """The fewest nodes the graph of a call like the recent eager ones would have: of the fewer of the
        last two (a generate's prefill and decode steps run different code in some models), at
        ``_GRAPH_NODES_PER_OP``."""
        return int(min(self.recent_ops, default=0) * _GRAPH_NODES_PER_OP)
