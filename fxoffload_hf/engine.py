"""The engine of one offloaded model: its store, copy engine, budget, schedule and statistics.

It is the ``torch.compile`` backend for the model (each captured graph gets a ``GraphExecutor``) and
the single source of truth for the budget every graph of the model shares.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from torch import fx

from fxoffload_hf.config import OffloadConfig
from fxoffload_hf.executor import GraphExecutor, TraceEvent
from fxoffload_hf.memory import format_bytes, return_large_frees_to_the_os
from fxoffload_hf.partition import BudgetTooSmallError, Partition, partition_graph
from fxoffload_hf.schedule import (
    PieceProfile,
    choose_distance,
    choose_resident,
    load_groups,
    window_bytes,
)
from fxoffload_hf.transfer import CopyEngine, arena_bytes, piece_arena_bytes, streams_from_file
from fxoffload_hf.weights import WeightStore

# the free budget is split this many ways into piece targets: under "auto" two pieces in flight take a
# quarter of it and the rest can stay resident; under "sequential" two pieces take all of it
_PIECE_DIVISOR = {"auto": 8, "sequential": 2}


@dataclass
class Stats:
    """Counters over the engine's lifetime."""

    calls: int = 0
    pieces_run: int = 0
    bytes_streamed: int = 0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    graphs: int = 0

    def add_piece(self, streamed: int, seconds: float) -> None:
        self.pieces_run += 1
        self.bytes_streamed += streamed
        self.copy_seconds += seconds if streamed else 0.0

    def add_call(self, wait_seconds: float) -> None:
        self.calls += 1
        self.wait_seconds += wait_seconds

    @property
    def hidden_copy_share(self) -> float:
        """Share of copy time that ran behind compute (1.0 when nothing was copied)."""
        if self.copy_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.copy_seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "graphs": self.graphs,
            "pieces_run": self.pieces_run,
            "bytes_streamed": self.bytes_streamed,
            "copy_seconds": round(self.copy_seconds, 4),
            "wait_seconds": round(self.wait_seconds, 4),
            "hidden_copy_share": round(self.hidden_copy_share, 4),
        }


class Engine:
    """Offload engine of one model; call it as a ``torch.compile`` backend."""

    def __init__(self, config: OffloadConfig, store: WeightStore, fixed_bytes: int = 0) -> None:
        self.config = config
        self.store = store
        self.device = config.device
        self.fixed_bytes = fixed_bytes  # small parameters and buffers kept on the device
        self.copy = CopyEngine(config.device)
        if self.budget is not None:
            return_large_frees_to_the_os()
        self.lock = threading.RLock()
        self.stats = Stats()
        self.executors: list[GraphExecutor] = []
        self.trace: list[TraceEvent] | None = None  # a list while a timeline is being recorded

    # -- budget ---------------------------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """Bytes the engine may hold where the model computes (None: no limit)."""
        cfg = self.config
        if self.device.type == "cuda":
            return cfg.gpu_memory
        return cfg.cpu_memory if cfg.cpu_memory is not None else cfg.gpu_memory

    @property
    def budget_name(self) -> str:
        if self.device.type == "cpu" and self.config.cpu_memory is not None:
            return "cpu_memory"
        return "gpu_memory"

    def smallest_budget(self, largest_atom: int, activation_bytes: int) -> int:
        return self.fixed_bytes + activation_bytes + 2 * piece_arena_bytes([largest_atom])

    def partition(
        self, graph: fx.Graph, weight_bytes: dict[fx.Node, int], activation_bytes: int
    ) -> Partition:
        """Partition a captured graph for this model's budget.

        Raises:
            BudgetTooSmallError: the budget cannot hold two of the largest unsplittable weight groups plus
                the activations; the message names the smallest budget that works.
        """
        budget = self.budget
        if budget is None:
            return partition_graph(graph, weight_bytes, max(sum(weight_bytes.values()), 1))
        available = budget - self.fixed_bytes - activation_bytes
        target = max(available // _PIECE_DIVISOR[self.config.policy], 1)
        try:
            # an unsplittable group larger than the target sits alone in its piece, as long as two such
            # pieces could still be in flight together
            result = partition_graph(graph, weight_bytes, target, max_atom=max(available // 2, target))
        except BudgetTooSmallError as exc:
            smallest = self.smallest_budget(exc.smallest_budget, activation_bytes)
            raise self._too_small(exc, smallest, activation_bytes) from None
        need = (
            self.fixed_bytes
            + activation_bytes
            + arena_bytes([piece_arena_bytes([weight_bytes[w] for w in p.weights]) for p in result.pieces])
        )
        if need > budget:
            smallest = self.smallest_budget(result.largest_atom_bytes, activation_bytes)
            if smallest > budget:
                raise self._too_small(BudgetTooSmallError("", smallest), smallest, activation_bytes)
            result = partition_graph(graph, weight_bytes, result.largest_atom_bytes)
        return result

    def _too_small(
        self, exc: BudgetTooSmallError, smallest: int, activation_bytes: int
    ) -> BudgetTooSmallError:
        detail = f" ({exc})" if str(exc) else ""
        return BudgetTooSmallError(
            f"{self.budget_name}={format_bytes(self.budget)} is too small for this model{detail}. "
            f"Two pieces in flight, {format_bytes(activation_bytes)} of activations and "
            f"{format_bytes(self.fixed_bytes)} of resident small tensors need at least "
            f"{format_bytes(smallest)}: pass {self.budget_name}={smallest} or more",
            smallest_budget=smallest,
        )

    # -- backend --------------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> GraphExecutor:
        """The ``torch.compile`` backend entry: one executor per captured graph."""
        return GraphExecutor(gm, example_inputs, self)

    def register(self, executor: GraphExecutor) -> None:
        self.executors.append(executor)
        self.stats.graphs = len(self.executors)
        self._make_room_for_activations(executor.activation_bytes)
        self._reserve_arena()

    def _make_room_for_activations(self, activation_bytes: int) -> None:
        """On the CPU, weights kept whole in RAM at offload time (activations unknown then) go to disk
        once a graph shows they leave no room for its activations; the schedule brings back what fits."""
        limit = self.config.cpu_memory
        if self.device.type != "cpu" or limit is None:
            return
        in_ram = [n for n, r in self.store.records.items() if r.host is not None]
        held = sum(self.store.records[n].nbytes for n in in_ram)
        if in_ram and self.fixed_bytes + held + activation_bytes > limit:
            self.store.spill_to_disk(in_ram, self.store.spill_folder(self.config.offload_folder))

    def schedule(self, executor: GraphExecutor) -> None:
        """Re-plan residency from a fresh profile: unhidden copies first, within the budget."""
        budget = self.budget
        if budget is None or self.config.policy != "auto":
            return
        fixed = self.fixed_bytes + max(e.activation_bytes for e in self.executors)
        wanted = choose_resident(executor.profile, budget, fixed)
        streamable = {
            n for n, r in self.store.records.items() if r.host is None or self.device.type == "cuda"
        }
        for name in streamable - wanted:
            self.store.evict(name)
            self.copy.unkeep(name)
        for name in wanted & streamable:
            record = self.store.records[name]
            if record.resident is None and record.host is None and self.copy.used_in_place(record):
                record.resident = self.copy.keep_mapped(record)  # on the CPU: its file's pages, kept
            else:
                self.store.make_resident(name)
        self._reserve_arena()
        for profiled in self.executors:  # the resident set changed for every graph
            if profiled.profile:
                profiled.distance = self._prefetch_distance(profiled, budget - fixed)
        self._reserve_arena()

    def _prefetch_distance(self, executor: GraphExecutor, room: int) -> int:
        """How far ahead to load this graph's pieces: from its profile, with what stays resident taken
        out, in the room the resident weights leave."""
        if self.copy.arena.capacity:
            return 1
        records = self.store.records
        on_cpu = self.device.type == "cpu"
        streamed_profiles = []
        for profile in executor.profile:
            streamed = {
                w: b
                for w, b in profile.weight_bytes.items()
                if records[w].resident is None and (records[w].host is None or not on_cpu)
            }
            share = sum(streamed.values()) / max(profile.nbytes, 1)
            streamed_profiles.append(
                PieceProfile(tuple(streamed), streamed, profile.copy_seconds * share, profile.compute_seconds)
            )
            room -= profile.nbytes - sum(streamed.values())
        return choose_distance(streamed_profiles, room)

    def _reserve_arena(self) -> None:
        """Size the staging arena for the bytes of consecutive pieces of every graph that pass through it,
        and note what two consecutive streamed pieces hold in all (arena or mapped pages). Loads that run
        on the calling thread hold one load at a time: there, consecutive pieces are loaded together while
        they fit in that room, so that fewer loads and unmappings run per call."""
        staged, in_flight = 0, 0
        streamed_by_executor = []
        for executor in self.executors:
            records = [[self.store.records[n] for n in names] for names in executor.piece_names]
            staged_pieces = [
                piece_arena_bytes([r.disk.nbytes for r in piece if r.disk and self.copy.needs_staging(r)])
                for piece in records
            ]
            streamed_pieces = [
                piece_arena_bytes([r.disk.nbytes for r in piece if r.disk and streams_from_file(r)])
                for piece in records
            ]
            if any(staged_pieces):
                staged = max(staged, arena_bytes(staged_pieces))
            if any(streamed_pieces):
                in_flight = max(in_flight, window_bytes(streamed_pieces, executor.distance + 1))
            streamed_by_executor.append(streamed_pieces)
        self.copy.arena.resize(staged)
        self.copy.in_flight_bytes = in_flight
        for executor, streamed_pieces in zip(self.executors, streamed_by_executor, strict=True):
            # staged pieces share the arena two at a time: those load one by one
            grouped = not staged and self.device.type == "cpu"
            executor.group_ends = load_groups(streamed_pieces, in_flight) if grouped else []

    def report(self) -> dict[str, Any]:
        """What the engine did and holds, for benchmarks and the command line (plain values only)."""
        return {
            "stats": self.stats.as_dict(),
            "store": self.store.summary(),
            "pieces": [len(e.piece_bytes) for e in self.executors],
            "arena_bytes": self.copy.arena.capacity,
            "in_flight_bytes": self.copy.in_flight_bytes,
        }

    def close(self) -> None:
        self.copy.close()
        self.executors.clear()
