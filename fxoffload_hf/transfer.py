"""The copy engine: brings a piece's weights to the compute device while the piece before computes.

- CPU device: host-tier weights are used in place (no copy); disk-tier weights are used in place too,
  as views of the checkpoint's mapped pages that the read-ahead thread faults in and that are unmapped
  after their piece ran (``mapped_io``). Only weights that must change dtype as they stream are read
  into a staging arena (``os.preadv``) and converted.
- CUDA device: host-tier weights (pinned) are copied on a side stream ordered by events, with
  ``record_stream`` so the caching allocator never reuses memory a copy or kernel still uses; disk-tier
  weights pass through a pinned staging arena first.

The staging arena holds two pieces at once: even pieces are laid out from its front, odd pieces from its
back, so two consecutive pieces never overlap as long as their sizes add up to its capacity.
"""

from __future__ import annotations

import time
from collections.abc import Container
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fxoffload_hf.mapped_io import MappedFiles, MappedGroup, can_map
from fxoffload_hf.memory import memory_limit
from fxoffload_hf.safetensors_io import TensorSlice, read_into
from fxoffload_hf.weights import WeightRecord, as_typed

_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class LoadedPiece:
    """The tensors of one piece, ready on the device, and how long bringing them took."""

    tensors: dict[str, torch.Tensor]
    started: float
    seconds: float
    streamed_bytes: int
    event: torch.cuda.Event | None = None
    mapped: MappedGroup | None = None  # the views of its file pages it holds


@dataclass(eq=False)
class _LoadPlan:
    """How the weights of one load come in, worked out once and reused while their tiers stay the same."""

    tiers: tuple[tuple[bool, bool, TensorSlice | None, torch.dtype], ...]  # what the plan was made for
    mapped_names: list[str]
    mapped: MappedGroup | None
    mapped_bytes: int
    staged: list[WeightRecord]  # read into the staging arena
    held: list[WeightRecord]  # resident, or held in RAM
    kept: list[TensorSlice]  # resident weights used in place: their files are checked at each load


class StagingArena:
    """One host buffer that two consecutive pieces share, from its two ends."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def resize(self, capacity: int) -> None:
        """Hold exactly ``capacity`` bytes (only between calls: nothing may live in it then)."""
        if capacity != self.capacity:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            if capacity:
                self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)

    def layout(self, sizes: list[int], side: int) -> list[torch.Tensor]:
        """Byte views for tensors of ``sizes`` from the front (side 0) or the back (side 1)."""
        total = sum(_aligned(s) for s in sizes)
        if total > self.capacity:
            raise RuntimeError(f"staging arena of {self.capacity} bytes cannot hold a piece of {total} bytes")
        start = 0 if side == 0 else self.capacity - total
        views, offset = [], start
        for size in sizes:
            views.append(self.buffer[offset : offset + size])
            offset += _aligned(size)
        return views

    def release(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)


def streams_from_file(record: WeightRecord) -> bool:
    """Whether bringing ``record`` in reads its file (neither kept on the device nor held in RAM)."""
    return record.resident is None and record.host is None and record.disk is not None


def piece_arena_bytes(tensor_bytes: list[int]) -> int:
    """Arena bytes one piece takes: its tensors laid out at aligned offsets."""
    return sum(_aligned(b) for b in tensor_bytes)


def arena_bytes(streamed_piece_bytes: list[int]) -> int:
    """Capacity a staging arena needs for pieces of these sizes run in order (two consecutive at once)."""
    sizes = list(streamed_piece_bytes) or [0]
    pairs = [a + b for a, b in zip(sizes, sizes[1:], strict=False)]
    return max(pairs + sizes)


class CopyEngine:
    """Loads pieces in the background; one per model, shared by all of its graphs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.arena = StagingArena(pin=self.is_cuda)
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxoffload-read")
        self.stream = torch.cuda.Stream(device) if self.is_cuda else None
        # Under a memory limit the page cache is charged to us: drop what we read. Without one it is the
        # kernel's reclaimable cache, and re-reads of streamed weights come from RAM instead of the disk.
        self.drop_cache = memory_limit() is not None
        self.files = MappedFiles()
        self.kept: dict[str, tuple[torch.Tensor, TensorSlice]] = {}  # resident weights used in place
        self._releases: list[MappedGroup] = []  # unmapped by the next load
        self._plans: dict[tuple[tuple[str, ...], Container[str]], _LoadPlan] = {}
        # bytes two consecutive streamed pieces take (arena or mapped pages): set by the engine's plan
        self.in_flight_bytes = 0

    def used_in_place(self, record: WeightRecord) -> bool:
        """Whether ``record`` streams as a view of its file's pages (the CPU, file dtype = compute dtype)."""
        return not self.is_cuda and record.disk is not None and can_map(record.disk, record.dtype)

    def keep_mapped(self, record: WeightRecord) -> torch.Tensor:
        """Fault ``record``'s pages in and keep them mapped: a resident weight with no private copy."""
        assert record.disk is not None
        view = self.files.view(record.disk)
        self.files.populate([view])
        self.kept[record.name] = (view, record.disk)
        return view

    def unkeep(self, name: str) -> None:
        """Unmap a weight kept by ``keep_mapped`` (no-op for others)."""
        pair = self.kept.pop(name, None)
        if pair is not None:
            self.files.release([pair[0]], self.drop_cache)

    def needs_staging(self, record: WeightRecord) -> bool:
        """Whether streaming ``record`` goes through the staging arena (else it is used in place)."""
        return streams_from_file(record) and not self.used_in_place(record)

    def submit(
        self, records: list[WeightRecord], side: int, lookups: Container[str] = (), *, inline: bool = False
    ) -> Future[LoadedPiece]:
        """Start bringing ``records`` to the device; the future resolves once they can be used.

        ``lookups`` names weights the graph only indexes rows of (embedding tables): used in place, their
        pages are not faulted in ahead, so a lookup reads the rows it needs and not the whole table.
        ``inline`` loads on the calling thread and returns a future already done.
        """
        releases, self._releases = self._releases, []
        if not inline:
            return self._reader.submit(self._load, records, side, lookups, releases)
        done: Future[LoadedPiece] = Future()
        try:
            done.set_result(self._load(records, side, lookups, releases))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def _load(
        self,
        records: list[WeightRecord],
        side: int,
        lookups: Container[str] = (),
        releases: list[MappedGroup] | None = None,
    ) -> LoadedPiece:
        if releases:
            self._unmap(releases)
        start = time.perf_counter()
        plan = self._plan(records, lookups)
        if plan.kept:
            self.files.check(plan.kept)
        tensors: dict[str, torch.Tensor] = {}
        streamed = 0
        if plan.mapped is not None:
            self.files.acquire(plan.mapped)
            tensors.update(zip(plan.mapped_names, plan.mapped.views, strict=True))
            streamed += plan.mapped_bytes
        if plan.staged:
            sources = [r.disk for r in plan.staged if r.disk is not None]
            views = self.arena.layout([s.nbytes for s in sources], side)
            read_into(sources, views, drop_cache=self.drop_cache)
            for record, source, view in zip(plan.staged, sources, views, strict=True):
                value = as_typed(view, source)
                tensors[record.name] = value if value.dtype == record.dtype else value.to(record.dtype)
                streamed += record.nbytes
        for record in plan.held:
            if record.resident is not None:
                tensors[record.name] = record.resident
            elif record.host is not None:
                tensors[record.name] = record.host
                streamed += record.nbytes if self.is_cuda else 0
        event = None
        if self.is_cuda:
            tensors, event = self._to_device(tensors)
        return LoadedPiece(tensors, start, time.perf_counter() - start, streamed, event, plan.mapped)

    def _plan(self, records: list[WeightRecord], lookups: Container[str]) -> _LoadPlan:
        """The plan of a load of ``records``: the one made before while their tiers and files are the same."""
        key = (tuple(r.name for r in records), lookups)
        tiers = tuple((r.resident is None, r.host is None, r.disk, r.dtype) for r in records)
        plan = self._plans.get(key)
        current = plan is not None and plan.tiers == tiers
        if plan is not None and current and (plan.mapped is None or self.files.is_current(plan.mapped)):
            return plan
        in_place: list[WeightRecord] = []
        staged: list[WeightRecord] = []
        held: list[WeightRecord] = []
        for record in {r.name: r for r in records}.values():  # a weight two pieces of a load share: once
            if streams_from_file(record):
                (in_place if self.used_in_place(record) else staged).append(record)
            elif record.resident is not None or record.host is not None:
                held.append(record)
        sources = [r.disk for r in in_place if r.disk is not None]
        mapped = self.files.group(sources, [r.name not in lookups for r in in_place]) if sources else None
        plan = self._plans[key] = _LoadPlan(
            tiers=tiers,
            mapped_names=[r.name for r in in_place],
            mapped=mapped,
            mapped_bytes=sum(s.nbytes for s in sources),
            staged=staged,
            held=held,
            kept=[self.kept[r.name][1] for r in held if r.resident is not None and r.name in self.kept],
        )
        return plan

    def release(self, piece: LoadedPiece) -> None:
        """Unmap the mapped weights of a piece that ran (pages that pieces loaded ahead use stay mapped)."""
        # done by the next load, before it maps its own piece: so no more pieces are mapped than are
        # loaded ahead
        if piece.mapped is not None:
            self._releases.append(piece.mapped)

    def flush(self, *, inline: bool = False) -> None:
        """Unmap what ``release`` set aside (at the end of a call: no load follows to carry it); with
        ``inline``, on the calling thread, so that it is done before the next call loads anything."""
        if self._releases:
            releases, self._releases = self._releases, []
            if inline:
                self._unmap(releases)
            else:
                self._reader.submit(self._unmap, releases)

    def _unmap(self, groups: list[MappedGroup]) -> None:
        self.files.release_groups(groups, self.drop_cache)

    def _to_device(
        self, tensors: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        assert self.stream is not None
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for name, tensor in tensors.items():
                out[name] = (
                    tensor if tensor.device == self.device else tensor.to(self.device, non_blocking=True)
                )
            event = torch.cuda.Event()
            event.record(self.stream)
        # staged host bytes may be overwritten by the next read only after these copies finish
        event.synchronize()
        return out, event

    def ready(self, piece: LoadedPiece) -> dict[str, torch.Tensor]:
        """Order the compute stream after the piece's copies (no host-blocking wait on CUDA)."""
        if piece.event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(piece.event)
            for tensor in piece.tensors.values():
                if tensor.device.type == "cuda":
                    tensor.record_stream(compute)
        return piece.tensors

    def detach_from_arena(self, value: Any) -> Any:
        """Clone any tensor in ``value`` that views the staging arena, which the next pieces overwrite."""
        if self.arena.capacity == 0:
            return value
        arena = self.arena.buffer.untyped_storage().data_ptr()
        return tree_map_only(
            torch.Tensor, lambda t: t.clone() if t.untyped_storage().data_ptr() == arena else t, value
        )

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.arena.release()
        self.kept.clear()
        self._plans.clear()
        self.files.close()
