"""Loaders: how the weights of a load reach the device, chosen once per weight by the plan.

Each weight comes in one ``Way``:

- ``HELD``: kept where the model computes (or, on the CPU, in RAM): used as it is;
- ``MAPPED``: a view of its file's pages, unmapped once its pieces ran; on the CPU faulted in ahead for the
  ops (a table read by rows is not), on CUDA only a table read by rows;
- ``STAGED``: read from its file into the staging arena (on the CPU only to change dtype; on CUDA,
  then copied to the device);
- ``COPIED`` (CUDA): copied from pinned host memory;
- ``ROWS`` (CUDA): a table the graph only looks rows up in, left in host RAM: the lookups gather their
  rows there and copy only those (``row_lookups``). From its file, such a table comes ``MAPPED`` for the
  same use.

A ``LoadSpec`` (built by the planner) lists a load's weights by way. A ``Loader`` runs specs behind one
protocol: ``load`` (on the read-ahead thread, or inline), ``ready`` (on the calling thread, before the
compute), ``release`` (after the load's last piece ran) and ``flush`` (at the end of a call). The CUDA
loader reaches the device only through ``DeviceOps``, so its ordering can be checked with a fake.
A ``Reader`` runs loads on a thread of their own or on the calling thread; the plan picks one.

On CUDA, a load that reads no file only queues copies from pinned memory on the side stream: the plan
runs it on the calling thread, and nothing waits for its copies but the compute stream. What bounds the
device memory in flight is the host waiting, before each load, until the device has computed every load
released so far (``CudaLoader``); their memory is then free for the new copies. A load with staged
weights waits for its own copies too (the next read overwrites the staging arena), and so does every load
of a profiled call (``time_copies``), so that copy times are measured.
"""

from __future__ import annotations

import enum
import functools
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxoffload_hf.mapped_io import MappedGroup
from fxoffload_hf.safetensors_io import TensorSlice, read_into
from fxoffload_hf.staging import StagingArena
from fxoffload_hf.weight_record import WeightRecord
from fxoffload_hf.weights import WeightStore, as_typed


class Way(enum.Enum):
    HELD = "held"
    MAPPED = "mapped"
    STAGED = "staged"
    COPIED = "copied"
    ROWS = "rows"


# the ways a table read by rows comes in where it lies, never whole: its file's pages, or (CUDA) host RAM
ROWS_WHERE_THEY_LIE = frozenset({Way.MAPPED, Way.ROWS})


def way_of(record: WeightRecord, device_type: str, *, rows_only: bool = False) -> Way:
    """How ``record`` comes in for a piece, given its tier and the compute device; ``rows_only``: the
    graph only looks rows up in it (copies of rows: its pages need no alignment for the compute; on CUDA
    the rows are gathered on the host, where the table lies)."""
    tier = record.tier
    if not tier.streams:
        return Way.HELD
    if device_type == "cpu":
        # rows looked up, and a tile of rows (mapped into its whole-shaped buffer), are copied from; a tile
        # of experts computes with its pages as they lie (``expert_tiles``)
        copied_from = rows_only or (record.tile_of is not None and record.tile_copied)
        return Way.MAPPED if (record.mappable if copied_from else record.in_place) else Way.STAGED
    if rows_only and record.host is not None:
        return Way.ROWS
    if rows_only and record.mappable:
        return Way.MAPPED
    return Way.STAGED if tier.from_file else Way.COPIED


@dataclass(frozen=True, eq=False)
class LoadSpec:
    """The weights of one load (one or more consecutive pieces) by the way each comes in."""

    held: tuple[WeightRecord, ...] = ()
    mapped: tuple[WeightRecord, ...] = ()
    staged: tuple[WeightRecord, ...] = ()
    copied: tuple[WeightRecord, ...] = ()
    rows: tuple[WeightRecord, ...] = ()
    fault_in: tuple[bool, ...] = ()  # per mapped weight: fault its pages in ahead (not for row lookups)
    side: int = 0  # end of the staging arena its staged weights take
    kept: tuple[TensorSlice, ...] = ()  # files of held weights kept as mapped pages: checked at each load
    leaves: tuple[str, ...] = ()  # weights whose parameter requires grad (``as_parameters``)

    @classmethod
    def build(
        cls, records: list[WeightRecord], device_type: str, lookups: frozenset[str], side: int
    ) -> LoadSpec:
        by_way: dict[Way, list[WeightRecord]] = {way: [] for way in Way}
        for record in {r.name: r for r in records}.values():  # a weight two pieces of a load share: once
            by_way[way_of(record, device_type, rows_only=record.name in lookups)].append(record)
        held = tuple(by_way[Way.HELD])
        return cls(
            held=held,
            mapped=tuple(by_way[Way.MAPPED]),
            staged=tuple(by_way[Way.STAGED]),
            copied=tuple(by_way[Way.COPIED]),
            rows=tuple(by_way[Way.ROWS]),
            fault_in=tuple(r.name not in lookups for r in by_way[Way.MAPPED]),
            side=side,
            kept=tuple(r.disk for r in held if r.mapped and r.disk is not None),
            leaves=tuple(r.name for by in by_way.values() for r in by if r.requires_grad),
        )

    @functools.cached_property
    def streamed_bytes(self) -> int:
        """Bytes this load brings in (file bytes of mapped weights, compute bytes of the others; a table
        read by rows on CUDA is not brought in)."""
        faulted = zip(self.mapped, self.fault_in, strict=True)
        mapped = sum(r.disk.nbytes for r, whole in faulted if whole and r.disk is not None)
        return mapped + sum(r.nbytes for r in (*self.staged, *self.copied))


@dataclass
class Loaded:
    """The tensors of one load, ready on the device, and how long bringing them took."""

    tensors: dict[str, torch.Tensor]
    started: float
    seconds: float
    streamed_bytes: int
    event: Any = None  # CUDA: the copies' completion
    mapped: MappedGroup | None = None  # the views of file pages it holds
    leaves: tuple[str, ...] = ()  # as ``LoadSpec.leaves``


def as_parameters(tensors: dict[str, torch.Tensor], leaves: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors as eager code sees its parameters: those named in ``leaves`` flagged as requiring
    grad, as their parameters are.

    ATen picks kernels by the flag even where no gradient is recorded: ``matmul`` folds a batched
    non-contiguous input into one ``mm`` when an operand requires grad, and runs a ``bmm`` (other
    rounding) when none does. So a batch's last-token logits (``logits_to_keep``) differ from eager by
    an ulp unless the weight carries its flag. Only without grad mode (``no_grad``, ``inference_mode``,
    ``generate``): under grad mode the flag would record autograd through streamed weights, which
    fxoffload does not support; there the activations usually require grad already, which folds alike.
    """
    if not leaves or torch.is_grad_enabled():
        return tensors
    flagged = dict(tensors)
    for name in leaves:
        flagged[name] = tensors[name].detach().requires_grad_()
    return flagged


class Reader(Protocol):
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]: ...


class ThreadedReader:
    """Runs loads on one read-ahead thread, behind the compute."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxoffload-read")

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class InlineReader:
    """Runs loads on the calling thread: where loads are far cheaper than the compute (cached pages on
    the CPU), a read-ahead thread would only take a core from the compute."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:
            done.set_exception(exc)
        return done


class Loader:
    """Brings loads in on the CPU; one per model, shared by all of its graphs."""

    device_type = "cpu"  # the kind of device its loads reach, for planning the way of each weight
    time_copies = False  # each load waits for its copies, so that they can be timed (CUDA's copies are async)

    def __init__(self, store: WeightStore, arena: StagingArena) -> None:
        self.store = store
        self.arena = arena
        self._groups: weakref.WeakKeyDictionary[LoadSpec, MappedGroup] = weakref.WeakKeyDictionary()
        self._releases: list[MappedGroup] = []  # unmapped by the next load, or at the end of the call

    def load(self, spec: LoadSpec) -> Loaded:
        """Bring ``spec``'s weights in (blocks: run it through a ``Reader``)."""
        if self._releases:
            releases, self._releases = self._releases, []
            self._unmap(releases)
        files = self.store.files
        start = time.perf_counter()
        if spec.kept:
            files.check(list(spec.kept))
        tensors: dict[str, torch.Tensor] = {}
        in_place: dict[str, torch.Tensor] = {r.name: r.host for r in spec.rows}  # type: ignore[misc]
        group = None
        if spec.mapped:
            group = self._group(spec)
            files.acquire(group)
            in_place.update(zip((r.name for r in spec.mapped), group.views, strict=True))
        if spec.staged:
            sources = [r.disk for r in spec.staged if r.disk is not None]
            views = self.arena.layout([s.nbytes for s in sources], spec.side)
            read_into(sources, views, drop_cache=self.store.drop_cache)
            for record, source, view in zip(spec.staged, sources, views, strict=True):
                value = as_typed(view, source)
                tensors[record.name] = value if value.dtype == record.dtype else value.to(record.dtype)
        for record in spec.held:
            tensors[record.name] = record.resident if record.resident is not None else record.host  # type: ignore[assignment]
        for record in spec.copied:
            tensors[record.name] = record.host  # type: ignore[assignment]
        tensors, event = self.to_device(tensors, wait=bool(spec.staged))
        tensors.update(in_place)  # used where they lie: on the CPU by the ops, on CUDA by row gathers
        seconds = time.perf_counter() - start
        return Loaded(tensors, start, seconds, spec.streamed_bytes, event, group, spec.leaves)

    def _group(self, spec: LoadSpec) -> MappedGroup:
        """The mapped views of ``spec``, made once and again only when a file was replaced."""
        files = self.store.files
        group = self._groups.get(spec)
        if group is None or not files.is_current(group):
            sources = [r.disk for r in spec.mapped if r.disk is not None]
            group = self._groups[spec] = files.group(sources, list(spec.fault_in))
        return group

    def to_device(self, tensors: dict[str, torch.Tensor], wait: bool) -> tuple[dict[str, torch.Tensor], Any]:
        """On the CPU the tensors are where they compute already (``wait``: the host must know the copies
        done before it returns, as it will overwrite their sources)."""
        return tensors, None

    def ready(self, loaded: Loaded) -> dict[str, torch.Tensor]:
        """The tensors, usable by the compute that follows (on the calling thread)."""
        return as_parameters(loaded.tensors, loaded.leaves)

    def detach(self, value: Any) -> Any:
        """``value`` with nothing left in it that the next loads overwrite."""
        return self.arena.detach(value)

    def release(self, loaded: Loaded) -> None:
        """The load's pieces ran: unmap its mapped weights (done by the next load, before it maps its own,
        so that no more pieces are mapped than are loaded ahead)."""
        if loaded.mapped is not None:
            self._releases.append(loaded.mapped)

    def flush(self, reader: Reader) -> None:
        """Unmap what ``release`` set aside (at the end of a call: no load follows to carry it)."""
        if self._releases:
            releases, self._releases = self._releases, []
            reader.submit(self._unmap, releases)

    def _unmap(self, groups: list[MappedGroup]) -> None:
        self.store.files.release_groups(groups, self.store.drop_cache)

    def close(self) -> None:
        self._groups.clear()
        self._releases.clear()
        self.arena.release()


class DeviceOps(Protocol):
    """The CUDA operations the CUDA loader uses; ``TorchCudaOps`` is the real one, tests use a fake."""

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """Start copies of the host tensors to the device on a side stream; returns an event after them."""
        ...

    def host_wait(self, event: Any) -> None:
        """Block this (read-ahead) thread until the copies before ``event`` are done."""
        ...

    def order_after(self, event: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Make the compute stream wait for ``event`` (no host block), and keep ``tensors`` alive for it."""
        ...

    def computed(self) -> Any:
        """An event on the compute stream after the work launched so far."""
        ...

    def wait_computed(self, event: Any) -> None:
        """Block this thread until the compute before ``event`` is done (what bounds the memory in flight)."""
        ...


class TorchCudaOps:
    """``DeviceOps`` on a real CUDA device: a side stream ordered by events, ``record_stream`` so the
    caching allocator never reuses memory a copy or kernel still uses."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        out: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.stream):
            for name, tensor in tensors.items():
                out[name] = (
                    tensor if tensor.device == self.device else tensor.to(self.device, non_blocking=True)
                )
            event = _host_waitable_event()
            event.record(self.stream)
        return out, event

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def order_after(self, event: Any, tensors: dict[str, torch.Tensor]) -> None:
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for tensor in tensors.values():
            if tensor.device.type == "cuda":
                tensor.record_stream(compute)

    def computed(self) -> Any:
        event = _host_waitable_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait_computed(self, event: Any) -> None:
        event.synchronize()


def _host_waitable_event() -> Any:
    # a host waiting on it sleeps instead of spinning: a spinning wait on the read-ahead thread slowed the
    # calling thread's kernel launches to twice eager's time per op (measured on an H200)
    return torch.cuda.Event(blocking=True)


class CudaLoader(Loader):
    """Brings loads to a CUDA device: pinned host weights and staged ones copied on a side stream."""

    device_type = "cuda"

    def __init__(self, store: WeightStore, arena: StagingArena, ops: DeviceOps) -> None:
        super().__init__(store, arena)
        self.ops = ops
        self._released: deque[Any] = deque()  # compute events after released loads, not yet waited for

    def to_device(self, tensors: dict[str, torch.Tensor], wait: bool) -> tuple[dict[str, torch.Tensor], Any]:
        # the device memory of released loads is reused once the compute that read it is done
        while self._released:
            self.ops.wait_computed(self._released.popleft())
        out, event = self.ops.copy_in(tensors)
        if wait or self.time_copies:
            self.ops.host_wait(event)
        return out, event

    def ready(self, loaded: Loaded) -> dict[str, torch.Tensor]:
        self.ops.order_after(loaded.event, loaded.tensors)
        return super().ready(loaded)

    def release(self, loaded: Loaded) -> None:
        self._released.append(self.ops.computed())
        super().release(loaded)

    def close(self) -> None:
        self._released.clear()
        super().close()

    def detach(self, value: Any) -> Any:
        return value  # results live on the device, never in the host arena


def make_loader(store: WeightStore, device: torch.device, ops: DeviceOps | None = None) -> Loader:
    """The loader for ``device``: CUDA through ``ops`` (the real device's unless given), else the CPU's."""
    if device.type == "cuda" or ops is not None:
        return CudaLoader(store, StagingArena(pin=ops is None), ops or TorchCudaOps(device))
    return Loader(store, StagingArena(pin=False))
