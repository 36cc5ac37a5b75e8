"""What captures hold, in the budget that counts it: each captured graph's state (dynamo's and ours, in host
memory, as long as the model lives), the room kept while a graph is traced, and the floor a refusal in the
middle of a call names (``call_progress``).

On the CPU a graph's state is counted in ``cpu_memory`` (``MemoryModel.with_graph``); on a GPU it lies in
host RAM beside the weights read into it, so it is charged to ``cpu_memory`` there (``host_room``) and the
device's budget does not count it. ``$FXOFFLOAD_HF_COUNT_GRAPH_STATE=0`` leaves it out (``config``).
Functions of the memory model: the engine sets what they return.
"""

from __future__ import annotations

from collections.abc import Iterable

from fxoffload_hf.call_progress import CallProgress
from fxoffload_hf.config import OffloadConfig, counts_graph_state
from fxoffload_hf.host_room import fit_host
from fxoffload_hf.memory_model import BudgetTooSmallError, MemoryModel, graph_state_bytes
from fxoffload_hf.weights import WeightStore


class CaptureBudget:
    """The captured graphs' state of one model, and the captures its calls still expect."""

    def __init__(self, config: OffloadConfig, store: WeightStore, memory: MemoryModel) -> None:
        self.config = config
        self.store = store
        cpu_memory = config.cpu_memory
        counts = counts_graph_state()
        # counted in the budget the model computes in (a CPU's), or charged to ``cpu_memory`` beside it
        self.in_budget = counts and memory.budget is not None and memory.budget_name == "cpu_memory"
        self.in_host = counts and config.device.type != "cpu" and cpu_memory is not None
        self.host_bytes = 0  # graphs' state charged to cpu_memory on a GPU run
        self.saved = config.compile_cache is not None  # each graph also saved in the compile cache
        self.graphs_expected = 0  # graphs there will be once the captures a call expects are made
        self.graph_weights: list[frozenset[str]] = []  # of each graph, the weights it uses
        # how far through the model a call is: a refusal inside it names the floor of the whole call
        self.progress = CallProgress(lambda: (r.name for r in store.weights()), self.graph_weights)

    def count(self, memory: MemoryModel, ops: int) -> MemoryModel:
        """A new graph of ``ops`` nodes is captured: ``memory`` counting its state (before its pieces are
        cut and its weights kept). On a GPU its state is charged to ``cpu_memory`` instead, whose weights in
        RAM make room for it and, while dynamo finishes the capture, its transient about as large."""
        if self.in_host:
            assert self.config.cpu_memory is not None
            state = graph_state_bytes(ops, self.saved)
            self.host_bytes += state
            fit_host(self.store, self.config.cpu_memory - self.host_bytes - state, self.config.offload_folder)
            return memory
        return memory.with_graph(ops, self.saved) if self.in_budget else memory

    def captured(self, weights: Iterable[str]) -> None:
        """The graph counted last is kept: it uses ``weights``."""
        self.graph_weights.append(frozenset(weights))

    def refused(self, refusal: BudgetTooSmallError, host_bytes: int, budget_name: str) -> BudgetTooSmallError:
        """The graph counted last is refused: its host state let go (``host_bytes`` as before it); the
        refusal names the floor of the whole call (``CallProgress.whole_call_refusal``)."""
        self.host_bytes = host_bytes
        return self.progress.whole_call_refusal(refusal, budget_name)

    def finished(self, memory: MemoryModel, graphs: int) -> MemoryModel:
        """A new graph's first call begins (dynamo has finished capturing it), ``graphs`` captured in all:
        ``memory`` keeping room for the next capture only while the call expects more graphs."""
        if not memory.capture_reserve:
            return memory
        return memory.with_capture_reserve(memory.capture_reserve if graphs < self.graphs_expected else 0)

    def expect(self, count: int, graphs: int) -> int:
        """A call that may capture ``count`` more graphs begins (generate: its prefill and decode graphs),
        ``graphs`` captured so far; what was expected before (give it to ``expected``)."""
        outer = self.graphs_expected
        self.graphs_expected = max(outer, graphs + count)
        if not outer:  # as many calls, each a pass through the model (an inner one is among them)
            self.progress.expect(count)
        return outer

    def expected(self, outer: int, memory: MemoryModel, graphs: int) -> MemoryModel:
        """The call that ``expect``ed graphs returns: ``memory`` without the room kept for them where
        the captures expected before it are made too."""
        self.graphs_expected = outer
        if not outer:
            self.progress.expect(0)
        if memory.capture_reserve and graphs >= outer:
            return memory.with_capture_reserve(0)
        return memory
