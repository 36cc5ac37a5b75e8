"""How far through the model a capturing call is: the floor a refusal in the middle of it names covers the
graphs still to come.

Where a budget counts captured graphs' state (``memory_model.graph_state_bytes``), a call that dynamo
cuts into many graphs (graph breaks in every layer: a mixture of experts routed by ``.tolist()``) is
refused at the first graph whose state no longer fits, naming the floor of the graphs captured so far.
Run at that budget, the call is refused at a later graph, naming a higher floor, and so on, once per few
graphs. The call's weights tell how far through the model it is: the graphs it captured hold state per
weight they use, and the weights no graph of the call has used yet are still to come, with about as much
state per weight. A refusal adds that, and the state of the calls the entry point still expects to
capture (generate: its decode step after the prefill), to the floor it names: an estimate, generous where
a call's first graph holds more than its share (masks, positions), so that the budget named runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from fxoffload_hf.memory_model import BudgetTooSmallError, format_bytes


class CallProgress:
    """The weights and the captured graphs' state of the current call (from ``starts``)."""

    def __init__(self, weights: Callable[[], Iterable[str]], graph_weights: Sequence[frozenset[str]]) -> None:
        self.weights = weights  # the model's stored weights (not tiles): what a call uses
        self.graph_weights = graph_weights  # per captured graph, the weights it uses (the engine's list)
        self.captured: set[str] = set()  # weights of the graphs this call captured
        self.state = 0  # their state's bytes
        self.graphs_ran: set[int] = set()  # graphs captured before this call that it ran
        self.calls_left = 0  # calls after this one an entry point expects to capture (``expect``)

    def starts(self) -> None:
        """A call that may capture begins."""
        self.captured.clear()
        self.graphs_ran.clear()
        self.state = 0
        self.calls_left = max(0, self.calls_left - 1)

    def expect(self, calls: int) -> None:
        """The next ``calls`` calls may each capture a pass through the model (generate's prefill and
        decode step); 0 when the entry point that expects them returns."""
        self.calls_left = calls

    def captures(self, weights: Iterable[str], state: int) -> None:
        """A graph using ``weights`` and holding ``state`` bytes is being captured in this call."""
        self.captured.update(weights)
        self.state += state

    def ran(self, graph: int) -> None:
        """Graph ``graph``, captured before, ran in this call."""
        self.graphs_ran.add(graph)

    def rest_bytes(self) -> int:
        """The state the rest of this call and the calls still expected would add, at this call's state
        per captured weight (0 where its graphs used no weight yet: nothing to scale by)."""
        weights = frozenset(self.weights())
        captured = self.captured & weights
        if not captured or not self.state:
            return 0
        seen = set(captured)
        for graph in self.graphs_ran:
            seen |= self.graph_weights[graph]
        per_weight = self.state / len(captured)
        still_to_come = len(weights - seen)
        return int(per_weight * (still_to_come + self.calls_left * len(weights)))

    def whole_call_refusal(self, refusal: BudgetTooSmallError, budget_name: str) -> BudgetTooSmallError:
        """``refusal`` naming the floor of the whole call: with the state of the graphs still to come."""
        rest = self.rest_bytes()
        if not rest:
            return refusal
        smallest = refusal.smallest_budget + rest
        calls = f", and the {self.calls_left} call(s) still expected," if self.calls_left else ""
        weights = frozenset(self.weights())
        why = (
            f"this call is cut into graphs as it runs: the graphs still to come{calls} hold about "
            f"{format_bytes(rest)} more (its graphs so far use {len(self.captured & weights)} of the "
            f"model's {len(weights)} weights)"
        )
        message = str(refusal)
        said = f"pass {budget_name}={refusal.smallest_budget} or more"
        if said in message:
            message = message.replace(said, f"{why}: pass {budget_name}={smallest} or more")
        else:
            message = f"{message}; {why}: pass {budget_name}={smallest} or more"
        return BudgetTooSmallError(message, smallest_budget=smallest)
