"""The engine of one offloaded model: the ``torch.compile`` backend that turns each captured graph into a
runner, and the owner of the model's plan.

Data flows one way: capture gives a graph; ``graphs`` measures it; ``planner`` partitions it and plans
every graph's loads for the weights' current tiers; ``program`` cuts it; ``runner`` runs the plan. A
graph's first call is profiled by an observer; its measurements go back through the planner (which
weights stay, how far ahead to load), the store moves the weights, and a new plan is swapped in whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from torch import fx

from fxoffload_hf import eager_paths, tiles
from fxoffload_hf.activations import activation_model
from fxoffload_hf.capture_budget import CaptureBudget
from fxoffload_hf.cohort import Cohort, SharedLock
from fxoffload_hf.config import OffloadConfig
from fxoffload_hf.deferral import Deferral
from fxoffload_hf.eager_fallback import EagerWeights
from fxoffload_hf.graph_entry import GraphEntry
from fxoffload_hf.graph_prep import prepare_graph
from fxoffload_hf.graphs import call_inputs, capture_device, graph_facts, retarget_devices
from fxoffload_hf.loaders import DeviceOps, InlineReader, ThreadedReader, make_loader
from fxoffload_hf.memory import return_large_frees_to_the_os
from fxoffload_hf.memory_model import BudgetTooSmallError, MemoryModel, format_bytes
from fxoffload_hf.partition import Partition
from fxoffload_hf.planner import GraphInput, ModelPlan, partition_for_budget, plan_model, sizes_for_budget
from fxoffload_hf.program import build_program
from fxoffload_hf.progress import report
from fxoffload_hf.runner import GraphRunner, Observer
from fxoffload_hf.schedule import PieceProfile, choose_resident
from fxoffload_hf.stats import Stats
from fxoffload_hf.weights import WeightStore

T = TypeVar("T")

# loads run inline when the last call's loads took less than this share of its compute: 5% to start
# loading inline, 20% to go back to the read-ahead thread (a margin either way, so the choice does not
# flicker)
_INLINE_SHARE = {False: 0.05, True: 0.2}

# A call whose activations outgrow the plan's has the plan remade for this many times them, where the budget
# allows: generate's KV cache grows with every token, and a plan remade at each one (residents chosen
# again, every graph's loads rebuilt, the arena resized) would cost every decode step; so it is remade a
# few times per generation.
_ACTIVATION_HEADROOM = 1.25


class Engine:
    """Offload engine of one model; call it as a ``torch.compile`` backend."""

    def __init__(
        self, config: OffloadConfig, store: WeightStore, memory: MemoryModel, ops: DeviceOps | None = None
    ) -> None:
        self.config = config
        self.store = store
        self.memory = memory
        self.device = config.device
        self.loader = make_loader(store, config.device, ops)
        self._threaded = ThreadedReader()
        self._inline = InlineReader()
        if memory.budget is not None:
            return_large_frees_to_the_os()
        self.lock = SharedLock()  # held for each call; a block's members pass through (``cohort``)
        self.cohort: Cohort | None = None  # the block of calls running now (``run_together``)
        self.stats = Stats()
        self.runners: list[GraphRunner] = []
        self.partitions: list[Partition] = []  # of each graph (sizes only: their nodes are dropped)
        self.activation_bytes: list[int] = []  # of each graph
        # what a running ``generate``'s KV cache will reach (``expect_activations``)
        self.expected_activations = 0
        self.weight_sizes: dict[str, int] = {}
        self.observers: tuple[Observer, ...] = ()  # watching every runner (timelines)
        # this engine's entry for each graph installed from the compile cache (``compile_cache.LoadedGraph``)
        self.installed_graphs: dict[object, Callable[..., Any]] = {}
        self._inputs: list[GraphInput] = []
        self._inline_now: list[bool] = []  # per graph: running its inline schedule
        self.plan: ModelPlan | None = None
        self.call_started = time.perf_counter()  # set by the entry point at each call: capture timing
        # capture="deferred": calls run eagerly while they fit (``deferral``)
        counts_ram = config.device.type != "cpu" or config.cpu_memory is not None
        self.captures = CaptureBudget(config, store, memory)  # captured graphs' state, where counted
        self.deferral = Deferral(
            config.capture == "deferred",
            memory,
            store,
            counts_ram,
            self.stats,
            counts_graph_state=self.captures.in_budget,
            offload_folder=config.offload_folder,
        )
        self.eager_depth = 0  # entry-point calls running eagerly now (nested entry points inside one)
        # whatever else checks the budget (the deferral, eager calls' lent weights): given the memory model
        # again when captured graphs' state is counted in it (``captures``)
        self.memory_holders: list[Deferral | EagerWeights] = [self.deferral]

    @property
    def deferring(self) -> bool:
        """Whether calls run eagerly before capture now (``deferral``)."""
        return self.deferral.on

    # -- backend --------------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> GraphEntry:
        """The ``torch.compile`` backend entry: one runner per captured graph."""
        received = time.perf_counter()
        traced_on = capture_device(example_inputs)
        if traced_on is not None and traced_on != self.device:
            retarget_devices(gm.graph, traced_on, self.device)
            gm.recompile()
        counted, host_counted = self.memory, self.captures.host_bytes
        self._count_graph_state(len(gm.graph.nodes))
        state = self.memory.graph_bytes - counted.graph_bytes  # in this budget
        try:
            return self._entry(gm, example_inputs, received, state)
        except BudgetTooSmallError as refusal:
            # a refused graph is not kept: nor is its state counted
            self._set_memory(counted)
            raise self.captures.refused(refusal, host_counted, counted.budget_name) from None

    def _entry(
        self, gm: fx.GraphModule, example_inputs: list[Any], received: float, state: int
    ) -> GraphEntry:
        """Cut a captured graph into pieces, plan them, and the entry that runs them."""
        facts = graph_facts(gm, example_inputs)
        weight_names = frozenset(facts.names[w] for w in facts.weight_bytes)
        self.captures.progress.captures(weight_names, state)
        device_type = self.loader.device_type
        gm, example_inputs, facts = prepare_graph(
            gm,
            example_inputs,
            facts,
            store=self.store,
            memory=self.memory,
            device_type=device_type,
            expected_activations=self.expected_activations,
            make_room=self._make_room_for_activations,
        )
        sizes = sizes_for_budget(
            facts.weight_bytes, facts.names, facts.lookups, self.store.records, device_type
        )
        partition = partition_for_budget(
            gm.graph,
            sizes,
            max(facts.activation_bytes, self.expected_activations),
            self.memory,
            self.config.policy,
            facts.names,
        )
        program = build_program(gm, partition, facts, self.config.compile)
        partition.forget_nodes()
        self.weight_sizes.update({facts.names[w]: b for w, b in facts.weight_bytes.items()})
        self.partitions.append(partition)
        self._inputs.append(GraphInput(program.piece_names, facts.lookups))
        self._inline_now.append(False)
        self.activation_bytes.append(facts.activation_bytes)
        plan = self._plan()
        runner = GraphRunner(program, self.loader, plan.graphs[-1].ahead, index=len(self.runners))
        runner.observers = self.observers
        self.runners.append(runner)
        self.captures.captured(weight_names)
        self.stats.graphs = len(self.runners)
        self._swap(plan)
        self._report_capture(gm, [facts.names[w] for w in facts.weight_bytes], program.pieces, received)
        weights = set(facts.weight_bytes)
        activations = activation_model(gm, weights, facts.activation_bytes)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        own = set(call_inputs(gm.graph, weights))
        return GraphEntry(self, runner, activations, tuple(i for i, n in enumerate(placeholders) if n in own))

    def _report_capture(self, gm: fx.GraphModule, names: list[str], pieces: int, received: float) -> None:
        """Log a graph captured: its size, and the model's weights it uses (``names``: a tile is its
        weight's, counted once)."""
        records = self.store.records
        weights = {(records[n].tile_of or n) if n in records else n for n in names}
        stored = sum(records[n].nbytes for n in weights if n in records)
        report(
            "graph %d captured %.1f s into the call: %d ops, %d weights (%s); cut into %d pieces in %.1f s",
            len(self.runners),
            received - self.call_started,
            len(gm.graph.nodes),
            len(weights),
            format_bytes(stored),
            pieces,
            time.perf_counter() - received,
        )

    def _count_graph_state(self, ops: int) -> None:
        """Count a new graph's state in the budget (``CaptureBudget.count``); kept weights that no longer
        fit beside it let go."""
        memory = self.captures.count(self.memory, ops)
        if memory is not self.memory:
            self._set_memory(memory)
            self._keep_fewer_weights()

    def capture_finished(self) -> None:
        """A new graph's first call begins: dynamo has finished capturing it (``CaptureBudget.finished``)."""
        self._set_memory(self.captures.finished(self.memory, len(self.runners)))

    @contextmanager
    def expecting_graphs(self, count: int) -> Iterator[None]:
        """Within: a call that may capture ``count`` more graphs (generate: its prefill and decode graphs).
        Until they are captured, a CPU budget keeps room to trace the next (``with_graph``)."""
        outer = self.captures.expect(count, len(self.runners))
        try:
            yield
        finally:
            self._set_memory(self.captures.expected(outer, self.memory, len(self.runners)))

    def _set_memory(self, memory: MemoryModel) -> None:
        self.memory = memory
        for holder in self.memory_holders:
            holder.memory = memory

    def _keep_fewer_weights(self) -> None:
        """Let go of kept weights that the budget, now counting more, no longer has room for: they were
        chosen from the last profile under the old count, and would otherwise stay until the new graph's
        profile, beside its state and its first call (only evictions: nothing is read here)."""
        profiles = [graph.profile for graph in self._inputs if graph.profile]
        if not profiles or self.config.policy != "auto":
            return
        kept = {
            name
            for name, record in self.store.records.items()
            if self.store.movable(record) and record.resident is not None
        }
        wanted = choose_resident(list(profiles[-1]), self.memory, self._activations(), self._held)
        if kept - wanted:
            self.store.set_residents(kept & wanted)
            self.replan()

    def _make_room_for_activations(self, activation_bytes: int) -> None:
        """On the CPU, weights kept whole in RAM at offload time (activations unknown then) go to disk
        once a graph shows they leave no room for its activations; the schedule brings back what fits."""
        if self.device.type != "cpu" or self.config.cpu_memory is None:
            return
        if not self.memory.fits(activations=activation_bytes, resident=self.store.ram_bytes()):
            self.store.spill_ram(self.config.offload_folder)

    def activations_grew(self, index: int, need: int) -> None:
        """A call of graph ``index`` holds ``need`` bytes of activations, more than the plan allowed for (a
        larger batch, longer inputs, a longer KV cache through the same graph): refuse it when its largest
        piece and they cannot fit the budget, else keep fewer weights and plan again, for a quarter more
        than ``need`` where that fits (``_ACTIVATION_HEADROOM``), before anything of it runs. Only this
        graph's pieces are in flight beside them (another graph's, cut when the budget had more room for
        weights, would make each refusal name a budget that cuts those larger again)."""
        largest = self._largest_piece(index)
        smallest = self.memory.smallest_budget(largest, need)
        budget = self.memory.budget
        if budget is not None and smallest > budget:
            raise self.memory.too_small(
                smallest, need, f"this call's activations take {format_bytes(need)}, more than earlier calls'"
            )
        ahead = int(need * _ACTIVATION_HEADROOM)
        if budget is None or self.memory.smallest_budget(largest, ahead) <= budget:
            need = ahead
        self.activation_bytes[index] = need
        self._make_room_for_activations(need)
        profile = self._inputs[index].profile
        if budget is not None:
            wanted = choose_resident(list(profile), self.memory, need, self._held) if profile else set()
            self.store.set_residents(wanted)
        self.replan()

    def expect_activations(self, need: int, what: str, instead: bool = False) -> None:
        """A ``generate`` about to start will hold ``need`` bytes of KV caches at its last step (``what``
        says how): refuse it now, before any weight is read, when they cannot fit beside the largest piece
        (before capture, the largest unit a weight streams in); else plan for them from the start.
        ``instead``: this replaces the expectation of a call that was given up (it may be lower)."""
        budget = self.memory.budget
        if instead:
            self.expected_activations = 0
        if budget is None or need <= self._activations():
            return
        smallest = self.memory.smallest_budget(self._largest_unit(), need)
        if smallest > budget:
            # fewer tokens help only where the rest (the largest piece, captured graphs' state) fits alone
            advice = (
                "ask for fewer new tokens or a smaller batch, or pass a larger budget"
                if self.memory.smallest_budget(self._largest_unit(), 0) <= budget
                else "the budget cannot hold the rest even without it"
            )
            raise self.memory.too_small(smallest, need, f"{what}: {advice}")
        self.expected_activations = need
        if self.plan is not None:
            self.replan()

    def fits_activations(self, need: int) -> bool:
        """Whether ``need`` bytes of activations fit the budget beside the largest piece (``_largest_unit``)."""
        budget = self.memory.budget
        return budget is None or self.memory.smallest_budget(self._largest_unit(), need) <= budget

    def run_together(
        self, calls: Sequence[Callable[[], T]], member_state: Sequence[tuple[object, str]] = ()
    ) -> tuple[list[T], list[int]]:
        """Run ``calls`` as one block (``cohort``): their results in order, and how many calls each graph
        run served."""
        cohort = Cohort(self.lock, member_state)
        with self.lock, eager_paths.inside(masks_by_value=self.device.type == "cuda"):
            if self.cohort is not None:
                raise RuntimeError("a block of calls is already running on this model; blocks do not nest")
            self.deferral.block_starts(len(calls))
            self.cohort = cohort
            try:
                return cohort.run(calls), cohort.group_sizes
            finally:
                self.cohort = None

    def _largest_piece(self, graph: int | None = None) -> int:
        """Weight bytes of the largest piece of graph ``graph``, or of any graph captured so far (0 before
        capture)."""
        parts = self.partitions if graph is None else self.partitions[graph : graph + 1]
        return max((p.weight_bytes for part in parts for p in part.pieces), default=0)

    def _largest_unit(self) -> int:
        """The largest piece; before capture, the largest unit a weight streams in (``tiles``)."""
        return self._largest_piece() or max(
            tiles.streaming_units(self.store, self.loader.device_type), default=0
        )

    def _activations(self) -> int:
        """What the plan leaves room for: the largest graph's activations, or a generate's final KV cache."""
        return max(max(self.activation_bytes, default=0), self.expected_activations)

    # -- planning -------------------------------------------------------------------------------
    def replan(self) -> None:
        """Plan every graph for the weights where the store has them now, and swap the plan in."""
        self._swap(self._plan())

    def _plan(self) -> ModelPlan:
        return plan_model(
            self._inputs,
            self.store.records,
            version=self.store.version,
            memory=self.memory,
            activations=self._activations(),
            device_type=self.loader.device_type,
            policy=self.config.policy,
            threaded=self._threaded,
            inline=self._inline,
            held=self.store.held_bytes,
        )

    def _held(self, names: Iterable[str]) -> int:
        """What the weights ``names`` hold at once where the model computes (``WeightStore.held_bytes``)."""
        return self.store.held_bytes(self.store.records[name] for name in names)

    def _swap(self, plan: ModelPlan) -> None:
        self.loader.arena.resize(plan.arena_bytes)
        self.plan = plan
        for runner, graph, inline in zip(self.runners, plan.graphs, self._inline_now, strict=True):
            runner.schedule = graph.schedule(inline)

    def profiled(self, runner: GraphRunner, profile: list[PieceProfile]) -> None:
        """Re-plan from a graph's measured profile: unhidden copies resident first, within the budget."""
        index = runner.index
        self._inputs[index] = replace(self._inputs[index], profile=tuple(profile))
        if self.memory.budget is not None and self.config.policy == "auto":
            wanted = choose_resident(profile, self.memory, self._activations(), self._held)
            self.store.set_residents(wanted)
        self.replan()
        report("graph %d profiled: weights now %s", index + 1, self.store.summary())

    def called(self, runner: GraphRunner, calls: int = 1) -> None:
        """Count a finished run of ``calls`` calls; on the CPU, load on the calling thread while loads cost
        little."""
        measure = runner.last
        self.stats.add_call(measure, calls)
        assert self.plan is not None
        graph = self.plan.graphs[runner.index]
        if graph.inline is not None:
            share = _INLINE_SHARE[self._inline_now[runner.index]]
            inline = measure.copy_seconds < share * measure.compute_seconds
            self._inline_now[runner.index] = inline
            runner.schedule = graph.schedule(inline)

    def current(self) -> None:
        """Plan again if the weights moved since the plan was made (``model.to(dtype)``, a spill)."""
        if self.plan is None or self.plan.version != self.store.version:
            self.replan()

    # -- figures and observers ------------------------------------------------------------------
    @contextmanager
    def observing(self, observer: Observer) -> Iterator[None]:
        """Let ``observer`` watch every piece of every graph inside the ``with`` block."""
        self._set_observers((*self.observers, observer))
        try:
            yield
        finally:
            self._set_observers(tuple(o for o in self.observers if o is not observer))

    def _set_observers(self, observers: tuple[Observer, ...]) -> None:
        self.observers = observers
        for runner in self.runners:
            runner.observers = observers

    def report(self) -> dict[str, Any]:
        """What the engine did and holds, for benchmarks and the command line (plain values only)."""
        return {
            "stats": self.stats.as_dict(),
            "store": self.store.summary(),
            "pieces": [r.program.pieces for r in self.runners],
            "arena_bytes": self.loader.arena.capacity,
            "in_flight_bytes": self.plan.in_flight_bytes if self.plan is not None else 0,
        }

    def close(self) -> None:
        self._threaded.close()
        self.loader.close()
        self.runners.clear()
