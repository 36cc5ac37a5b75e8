"""Whether capturing a call like the recent eager ones could fit the budget at all, and whether a capture
chosen for speed would hold more than its share of it (``SPEED_STATE_SHARE``), told before anything is
traced: a captured graph holds host memory in proportion to its nodes (``memory_model.graph_state_bytes``),
and has at least ``_GRAPH_NODES_PER_OP`` nodes per torch operation its eager call ran (``eager_ops``). A
capture the budget then refuses would have cost its tracing and left host memory behind; counting costs
each operation a Python call, so only some eager calls count.
"""

from __future__ import annotations

from fxoffload_hf.memory_model import MemoryModel, format_bytes

# A captured graph's nodes per torch operation its eager call ran, at least (``eager_ops``; measured on
# twelve architectures, dense, mixtures of experts and Mamba, prefill and decode: 0.80 to 1.04): below
# it, a capture's state is not overestimated, so no capture that could fit is skipped.
_GRAPH_NODES_PER_OP = 0.75
# and at most (measured too on Falcon, GPT-2, StarCoder2, Llama, BERT and BioGPT at hidden 256, a batch of
# three: 0.91 to 1.34, the most where the graph adds casts and masks the eager call does not run): a
# capture for speed is judged by the state it may hold
_GRAPH_NODES_PER_OP_MOST = 1.35
# Eager calls count their operations in the first few calls, then in one call of so many: a kind of
# call keeps its graph's size, and counting costs each operation about 2 us (a Python call per operation,
# several percent of a decode step whose weights are cached).
_COUNTED_FIRST = 4
_COUNTED_EVERY = 16
# Captures chosen for speed hold at most this share of the budget in graphs' state: tracing leaves that
# host memory behind for good (measured on an 8-layer Llama: 82% of its graph's state stays after the
# graph is dropped and dynamo reset), and later calls may need the rest as eager code. A tiny model's
# graphs hold as much as its weights: Falcon at hidden 256 captured a forward for speed, holding 42% of a
# 17 MiB budget, then a beam search that fitted that budget as eager code no longer fitted beside it.
SPEED_STATE_SHARE = 0.25


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

    def state_for_speed(self, memory: MemoryModel) -> int | None:
        """Where a capture chosen for speed of a call like the recent eager ones would bring the graphs'
        state above ``SPEED_STATE_SHARE`` of ``memory``'s budget, that state (at the most nodes
        predicted, ``likely_nodes``); None where it stays within it, or nothing tells."""
        budget = memory.budget
        if not self.predicts(memory) or budget is None or not self.recent_ops:
            return None
        state = memory.with_graph(self.likely_nodes()).graph_bytes
        return state if state > SPEED_STATE_SHARE * budget else None

    def against_speed(self, memory: MemoryModel, keeps_share: bool = True) -> str | None:
        """Why a capture chosen for speed of a call like the recent eager ones is not taken: it surely
        cannot fit ``memory``'s budget (``least_to_capture``), or (``keeps_share``) would bring the graphs'
        state above ``SPEED_STATE_SHARE`` of it (``state_for_speed``); None where neither holds, or
        nothing tells."""
        budget = f"{memory.budget_name}={format_bytes(memory.budget)}"
        least = self.least_to_capture(memory)
        if least is not None:
            return (
                f"a graph of about {self.predicted_nodes()} ops would need at least {format_bytes(least)} "
                f"for its state and its capture beside what is counted, more than {budget}"
            )
        state = self.state_for_speed(memory) if keeps_share else None
        if state is not None:
            return (
                f"a graph of up to {self.likely_nodes()} ops would bring the captured graphs' state to "
                f"{format_bytes(state)}, more than {SPEED_STATE_SHARE:.0%} of {budget}"
            )
        return None

    def predicted_nodes(self) -> int:
        """The fewest nodes the graph of a call like the recent eager ones would have: of the fewer of the
        last two (a generate's prefill and decode steps run different code in some models), at
        ``_GRAPH_NODES_PER_OP``."""
        return int(min(self.recent_ops, default=0) * _GRAPH_NODES_PER_OP)

    def likely_nodes(self) -> int:
        """The most nodes the graph of a call like the recent eager ones would have: of the more of the
        last two, at ``_GRAPH_NODES_PER_OP_MOST``."""
        return int(max(self.recent_ops, default=0) * _GRAPH_NODES_PER_OP_MOST)
