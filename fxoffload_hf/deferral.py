"""Deferred capture (``capture="deferred"``, the default): whether an entry point's call runs as eager
code now, each module lent its weights for its call, or is captured; and which weights eager calls keep.

A call runs eagerly while deferring lasts and its bound (``eager_memory``) fits the budget beside the
largest module's weights lent whole and a generate's expected KV caches. What the budget leaves beside
them keeps weights where the model computes (mapped file pages on the CPU, device copies on a GPU), in
the model's order, as accelerate's placement does: those are not read again at each call. They are kept
for the largest call seen, let go (last kept first) only for a larger one. Deferring
ends, and every later call is captured, when a call does not fit (capture measures its activations and
streams the weights in pieces around them), when eager calls have taken about what capture costs (a
ski-rental rule), or when a block of calls starts (each weight is then read once for all). A capture
chosen for speed that the budget refuses (its pieces can group weights that eager calls are lent one
module at a time) sends the calls back to eager code for good, the refused call with them where the
graphs that ran before the refusal changed nothing it was given (``entries``). When deferring ends the weights it kept
are let go: the captured schedule chooses its own from its profile.

After deferring ended, a call that no captured graph serves (a plain forward after a generate, a batch of
another kind: dynamo would capture a graph for it) runs eagerly too, rather than paying a capture for one
call, while such calls have taken less than a graph's capture is estimated to cost and its bound fits
beside the weights the graphs keep; then it is captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from fxoffload_hf.capture_forecast import CaptureForecast
from fxoffload_hf.memory_model import BudgetTooSmallError, MemoryModel, format_bytes
from fxoffload_hf.progress import report
from fxoffload_hf.stats import Stats
from fxoffload_hf.weights import HeldBytes, WeightStore

# Capture's cost per module lent weights in one eager call: dynamo traces each such module with its
# neighbours once per graph, and generate captures two. Measured here on a 10-layer Llama (72 such
# modules): about 7.5 s for both graphs, 0.1 s a module.
_CAPTURE_SECONDS_PER_MODULE_CALL = 0.1


@dataclass(frozen=True)
class Lending:
    """How eager calls are lent weights, one module at a time: the largest module's bytes lent whole
    (``largest``, of module ``largest_name``), what such a module can hold mapped (whole 2 MiB units,
    ``span``), and the weights eager calls use whole in the model's order (those they may keep)."""

    largest: int = 0
    largest_name: str = ""
    span: int = 0
    keepable: Sequence[str] = ()


class Tiles(Protocol):
    """Projections eager calls can compute in tiles (``eager_fallback.EagerWeights``)."""

    def lending_in_tiles(self, room: int) -> Lending:
        """How calls would be lent weights with tiles sized for ``room`` bytes beside a call."""
        ...

    def use_tiles(self, room: int) -> Lending:
        """Turn such tiles on; the lending then."""
        ...


class Deferral:
    """The deferred-capture state of one model's engine."""

    def __init__(
        self,
        on: bool,
        memory: MemoryModel,
        store: WeightStore,
        counts_ram: bool,
        stats: Stats,
        counts_graph_state: bool = False,
        offload_folder: Path | None = None,
    ) -> None:
        self.on = on  # calls run eagerly (while they fit)
        self.deferred_capture = on  # capture="deferred" was asked for
        self.memory = memory
        self.store = store
        # a CPU run sized by gpu_memory (as if a device had it) does not count the weights in RAM, and
        # keeps none for eager calls
        self.counts_ram = counts_ram
        self.stats = stats
        # whether a capture surely cannot fit, from the operations eager calls ran (``eager_ops``)
        self.forecast = CaptureForecast(counts_graph_state)
        self.offload_folder = offload_folder  # where weights held only in RAM go to make room (``config``)
        self.lending = Lending()  # how eager calls are lent weights now
        # where projections can be computed in tiles (``eager_tiles``), sized for the room beside a call:
        # turned on only by a call that does not fit as lent now and fits with them (tiles compute the
        # projection once per tile), and then kept (made smaller if need be)
        self.tiles: Tiles | None = None
        self.by_choice = False  # deferring ended for speed (cost or a block), not for the budget
        self.refused = False  # such a capture needed more than the budget: calls stay eager
        # a capture for speed would have held more than its share of the budget in graphs' state: the
        # ski-rental rule does not choose one again (a block, asked for by the caller, still may)
        self.kept_share = False
        self.eager_floor: int | None = None  # the budget the eager call that ended deferring needed
        # what the modules lent to the last eager call may hold at once: the one computing and the next,
        # read ahead (``eager_read_ahead``); None: no limit
        self.in_flight_room: int | None = 0
        self._kept: list[str] = []  # weights kept for eager calls, in the order kept
        self._largest_need = 0  # the largest bound of an eager call so far
        self._eager_seconds = 0.0
        self._most_module_calls = 0  # lent in one eager call, at most
        # a capture of a call no graph served was refused for the budget: such calls run eagerly where
        # they fit, in either capture mode, and are not captured for speed again (``refused_new_graph``);
        # the kinds of call refused (``entries.call_kind``: a graph of the frame they enter may serve them,
        # another past a graph break is the one refused)
        self.new_graphs_refused = False
        self.refused_kinds: set[object] = set()
        # calls no graph served after deferring ended, run eagerly since the last capture, and their seconds
        self._uncaptured_calls = 0
        self._uncaptured_seconds = 0.0

    def runs_eagerly(self, need: int | None, expected: int) -> bool:
        """Whether a call bounded by ``need`` bytes beside its weights (``eager_memory``; None: no bound)
        runs eagerly, with ``expected`` bytes of a generate's KV caches; the first that cannot ends
        deferring. Weights are kept, or let go, to fill what the call leaves of the budget."""
        if not self.on:
            return False
        budget = self.memory.budget
        if budget is None:
            self.in_flight_room = None
            return True
        if need is not None:
            # weights are kept for the largest call seen, so that a generate's prefill and decode steps do
            # not let go and keep the same weights by turns
            self._largest_need = max(self._largest_need, need)
            activations = max(need, expected)
            beside = budget - self.memory.need(activations=activations)  # the room for weights
            self._tile_if_need_be(beside)
            room = beside - self.lending.largest
            room_to_keep = budget - self.memory.need(
                activations=max(self._largest_need, expected), in_flight=self._lent_at_once()
            )
            kept = self._fill(room, room_to_keep)
            if kept is None and self._spill_weights_only_in_ram():
                kept = self._fill(room, room_to_keep)
            if kept is not None:
                # the module lent now, and one read ahead in what keeping left (RAM not counted: no limit)
                in_flight = self._lent_at_once() + max(room_to_keep - kept, 0)
                self.in_flight_room = in_flight if self.counts_ram else None
                return True
            self.eager_floor = self._eager_floor(activations)
            least = self.forecast.least_to_capture(self.memory, expected=expected, transient=False)
            if least is not None and self.eager_floor <= least:
                raise self._too_small_to_capture(need, least, self.eager_floor)
        detail = (
            "its activations cannot be bounded from its inputs and the config"
            if need is None
            else f"its activations (at most {format_bytes(need)}) and the largest module's weights "
            f"({self.lending.largest_name}: {format_bytes(self.lending.largest)}) do not fit {self.memory.budget_name}="
            f"{format_bytes(budget)} as eager code; the captured call streams them in pieces"
        )
        self.end(f"capturing from this call, not running it eagerly: {detail}", by_choice=False)
        return False

    def runs_uncaptured(self, need: int | None, expected: int) -> bool:
        """Whether a call that no captured graph serves, after deferring ended, runs as eager code instead
        of being captured (a plain forward after a generate, a batch of a new kind): while such calls have
        taken less than a graph's capture is estimated to cost (the ski-rental rule, per graph), and its
        bound ``need`` fits the budget beside the weights kept for the graphs and the largest module lent
        whole, with ``expected`` bytes of a generate's KV caches. Nothing is let go for it, except where a
        new graph was refused (``refused_new_graph``, in either capture mode): then with no ski-rental
        rule, and the weights the graphs kept are let go where the call needs their room."""
        if self.on or not (self.deferred_capture or self.new_graphs_refused) or need is None:
            return False
        if (
            not self.new_graphs_refused
            and self._uncaptured_seconds >= self._graph_capture_seconds()
            and not self._cannot_capture("for a call no graph serves")
        ):
            report(
                "capturing a new graph from this call: %d eager calls no graph served took %.1f s, about "
                "what its capture is estimated to take",
                self._uncaptured_calls,
                self._uncaptured_seconds,
            )
            self._uncaptured_calls, self._uncaptured_seconds = 0, 0.0  # the next new graph rents again
            return False
        budget = self.memory.budget
        if budget is None:
            self.in_flight_room = None
            return True
        kept = HeldBytes(self.store, [r for r in self.store.records.values() if r.resident is not None])
        activations = max(need, expected)
        self._tile_if_need_be(budget - self.memory.need(activations=activations, resident=kept.total))
        lent = self._lent_at_once()
        spare = budget - self.memory.need(activations=activations, resident=kept.total, in_flight=lent)
        if spare < 0 and self.new_graphs_refused:
            # the graphs' plan kept what the budget left: let go of weights (the last first) for a call
            # no graph can serve; the next captured call plans again (``Engine.current``). Where it still
            # does not fit, the refusal of its capture names the budget it needs (``or_eagerly``)
            resident = [r.name for r in self.store.records.values() if r.resident is not None]
            kept = self._let_go(kept.total + spare, resident)
            spare = budget - self.memory.need(activations=activations, resident=kept.total, in_flight=lent)
            if spare < 0:
                self.eager_floor = self._eager_floor(activations)
        if spare < 0:
            return False
        self.in_flight_room = lent + spare if self.counts_ram else None
        return True

    def _eager_floor(self, activations: int) -> int:
        """The budget at which deferred capture runs a call holding ``activations`` as eager code: the
        fewest bytes a call can be lent (projections in their smallest tiles) beside them, before any graph
        is captured (the graphs a larger budget captures before a refusal hold more, so a floor counting
        those would be refused again)."""
        lent = self.lending.largest
        if self.tiles is not None:
            lent = min(lent, self.tiles.lending_in_tiles(0).largest)
        before_capture = replace(self.memory, graph_bytes=0, capture_reserve=0)
        return before_capture.need(activations=activations, in_flight=lent)

    def refused_new_graph(self, refusal: BudgetTooSmallError, kind: object) -> None:
        """The budget refused the capture of a call of ``kind`` (its graph's state or activations beside
        the graphs held): such calls, and calls no graph serves, run as eager code from now on where they
        fit (``runs_uncaptured``), in either capture mode; those that do not are captured, and may be
        refused."""
        if not self.new_graphs_refused:
            report("calls no graph serves run as eager code where they fit from now on: %s", refusal)
        self.eager_floor = None  # another call's: sized again where this one does not fit
        self.new_graphs_refused = True
        self.refused_kinds.add(kind)

    def ran_eagerly(self, seconds: float, module_calls: int, ops: int = 0) -> None:
        """An entry point's call ran eagerly, ``ops`` torch operations in all: capture from the next call
        on once the eager calls took about what capture is estimated to cost (when the estimate is right,
        the time lost against the better choice in hindsight is at most capture's cost), unless such a
        capture cannot fit the budget (``CaptureForecast.least_to_capture``)."""
        self.stats.eager_calls += 1
        self._most_module_calls = max(self._most_module_calls, module_calls)
        if ops:
            self.forecast.counted(ops)
        if not self.on:  # a call no graph served (``runs_uncaptured``)
            self._uncaptured_calls += 1
            self._uncaptured_seconds += seconds
            return
        self._eager_seconds += seconds
        worth_it = self._eager_seconds >= self._most_module_calls * _CAPTURE_SECONDS_PER_MODULE_CALL
        chooses = self.on and not self.refused and not self.kept_share and worth_it
        if chooses and not self._cannot_capture("for speed"):
            self.end(
                f"capturing from the next call: {self.stats.eager_calls} eager calls took "
                f"{self._eager_seconds:.1f} s, about what capture is estimated to take",
                by_choice=True,
            )

    def block_starts(self, calls: int) -> None:
        """A block of ``calls`` calls is about to run: eager calls would each read every weight."""
        # asked for by the caller, a block keeps no share of the budget back: only a capture that surely
        # cannot fit is not taken
        block = f"for a block of {calls} calls"
        if self.on and not self.refused and not self._cannot_capture(block, keeps_share=False):
            self.end(
                f"capturing from this block of {calls} calls: each weight is then read once for all", True
            )

    def stay_eager(self, refusal: BudgetTooSmallError) -> None:
        """A capture chosen for speed needs more than the budget: calls go on eagerly, and capture is not
        tried again for speed."""
        self.on, self.by_choice, self.refused = True, False, True
        report("capture does not fit the budget, so calls go on eagerly (as before): %s", refusal)

    def or_eagerly(self, refusal: BudgetTooSmallError) -> BudgetTooSmallError:
        """A refusal of a call captured because it did not fit as eager code: where that eager call
        needed less than the capture (a small model whose graphs' state outweighs its weights), the
        refusal names that budget too, the smallest that runs (as eager calls); under first-call capture,
        as deferred capture's budget, capture's staying the one named to work."""
        floor, budget = self.eager_floor, self.memory.budget
        if floor is not None and not self.deferred_capture and floor < refusal.smallest_budget:
            # first-call capture's own budget stays the one named to work: at a larger one, the graphs
            # captured before a refusal hold more than at this one
            name = self.memory.budget_name
            budget_named = "at this budget" if budget and floor <= budget else f"and {name}={floor} or more"
            return BudgetTooSmallError(
                f'{refusal}; or pass capture="deferred" {budget_named} to run its calls as eager code, each '
                "module lent its weights in turn (captured for speed only where that fits)",
                smallest_budget=refusal.smallest_budget,
            )
        # a floor the budget already meets is another call's: eager calls did not serve this one
        if floor is None or floor >= refusal.smallest_budget or (budget is not None and floor <= budget):
            return refusal
        return BudgetTooSmallError(
            f"{refusal}; or pass {self.memory.budget_name}={floor} or more to run its calls as eager code, "
            "each module lent its weights in turn (no capture: slower for long jobs, as its weights are "
            "read at every call)",
            smallest_budget=floor,
        )

    def resume(self, why: str) -> None:
        """Defer again after deferring ended for the budget, where the call that ended it is given up and
        run again holding less (a generate's KV cache moved to disk) and no graph was captured."""
        if self.on or self.by_choice or not self.deferred_capture:
            return
        self.on = True
        report("calls run eagerly again: %s", why)

    def end(self, why: str, by_choice: bool) -> None:
        """Stop deferring (``why`` is logged): let go of the weights kept for eager calls."""
        self.on, self.by_choice = False, by_choice
        self.in_flight_room = 0  # sized again by the next call that runs eagerly
        self._let_go(0)
        report("%s", why)

    def counts_this_call(self) -> bool:
        """Whether the next eager call counts its operations (``CaptureForecast.counts``)."""
        return self.forecast.counts(self.memory, self.stats.eager_calls)

    def _cannot_capture(self, why: str, keeps_share: bool = True) -> bool:
        """Whether a capture chosen ``why`` (for speed) surely cannot fit, or (``keeps_share``) would hold
        more than its share of the budget in graphs' state (``CaptureForecast.against_speed``): then calls
        go on eagerly, and capture is not chosen for speed again (``refused``; for the share only,
        ``kept_share``: a block may still be captured). Nothing is traced: a capture costs its tracing and
        leaves host memory behind."""
        against = self.forecast.against_speed(self.memory, keeps_share)
        if against is None:
            return False
        if self.forecast.least_to_capture(self.memory) is None:
            self.kept_share = True  # it would fit: only the share kept it back
        else:
            self.refused = True
        self._uncaptured_calls, self._uncaptured_seconds = 0, 0.0
        report("not capturing %s: %s; calls go on eagerly", why, against)
        return True

    def _too_small_to_capture(self, need: int, least: int, floor: int) -> BudgetTooSmallError:
        """The refusal of a call that fits neither as eager code nor, surely, captured: it names the
        budget its eager calls need (the smaller), with nothing traced."""
        name = self.memory.budget_name
        return BudgetTooSmallError(
            f"{name}={format_bytes(self.memory.budget)} is too small for this call: as eager code its "
            f"activations (at most {format_bytes(need)}) and the largest module's weights "
            f"({self.lending.largest_name}: {format_bytes(self.lending.largest)}) need {format_bytes(floor)}, "
            f"and captured, a graph of about {self.forecast.predicted_nodes()} ops would need at least "
            f"{format_bytes(least)} with its state. Pass {name}={floor} or more to run its "
            "calls as eager code, each module lent its weights in turn, or call it with a smaller batch or "
            "shorter inputs",
            smallest_budget=floor,
        )

    def _graph_capture_seconds(self) -> float:
        """Capture's estimated cost of one graph (``_CAPTURE_SECONDS_PER_MODULE_CALL`` is for two), from the
        modules an eager call was lent weights, at most; before any eager call (deferring ended at the
        first call), from the modules that own the model's weights, which such a call would be lent."""
        modules = self._most_module_calls or len({r.name.rpartition(".")[0] for r in self.store.weights()})
        return modules * _CAPTURE_SECONDS_PER_MODULE_CALL / 2

    def _tile_if_need_be(self, beside: int) -> None:
        """Where the largest module cannot be lent whole in ``beside`` bytes for weights and its projection in
        tiles can, compute it in tiles sized for them from now on (``Tiles``)."""
        tiles = self.tiles
        if tiles is not None and self.lending.largest > beside >= tiles.lending_in_tiles(beside).largest:
            self.lending = tiles.use_tiles(beside)

    def _lent_at_once(self) -> int:
        """What the module lent to an eager call can hold at most (its weights, or their mapped span)."""
        return max(self.lending.largest, self.lending.span)

    def _fill(self, room: int, room_to_keep: int) -> int | None:
        """Let go of the last kept weights first until those kept fit ``room`` bytes, keep more up to
        ``room_to_keep``; the bytes the weights kept then hold, None where they do not fit ``room``."""
        if not self.counts_ram:
            return 0 if room >= 0 else None
        held = self._let_go(room)
        for name in self.lending.keepable:
            record = self.store.records[name]
            if (
                record.resident is None
                and held.total + held.cost(record) <= room_to_keep
                and self.store.movable(record)
            ):
                self.store.keep(name)
                self._kept.append(name)
                held.add(record)
        return held.total if held.total <= room else None

    def _spill_weights_only_in_ram(self) -> bool:
        """Write the weights whose only copy is in RAM (a CPU run's weights materialized in memory, kept
        at offload time because they fit the budget beside nothing else) to the offload folder, so that
        they stream and an eager call's weights and activations fit beside what stays; whether any were
        (``Engine._make_room_for_activations`` does the same for a captured graph's activations)."""
        # on a GPU run weights in RAM are the host tier, which streams: only a CPU run's stay put
        if not self.counts_ram or self.store.device.type != "cpu":
            return False
        if self.store.spill_ram(self.offload_folder) is None:
            return False
        report("weights held only in RAM written to disk: they left an eager call no room")
        return True

    def _let_go(self, room: int, kept: list[str] | None = None) -> HeldBytes:
        """Stop keeping the weights last in ``kept`` (where None, those kept for eager calls) until the
        weights kept fit ``room`` bytes; the bytes kept then."""
        order = self._kept if kept is None else kept
        while True:
            resident = {id(r): r for r in self.store.records.values() if r.resident is not None}
            held = HeldBytes(self.store, list(resident.values()))
            if not order or held.total <= room:
                return held
            self.store.evict(order.pop())
