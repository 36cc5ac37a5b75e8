"""The CUDA loader's and runner's ordering, checked without a GPU.

``FakeCudaOps`` is a ``DeviceOps`` on CPU tensors whose copies are asynchronous: ``copy_in`` only queues
them on a fake side stream (the destinations start as NaN), and they run, in issue order, when the host
waits for their event (``host_wait``) or the compute stream is ordered after it (``order_after``). It
logs every operation with its thread and records a violation when

- ``overwrite``: staging bytes that a copy not yet known done by the host reads are handed to a new copy
  (so the read-ahead thread wrote them again), or a copy's source changed before the copy ran;
- ``unordered``: ``ready`` hands the compute tensors whose copy the compute stream was not ordered after;
- ``host-block``: the calling (compute) thread waits for copies in the steady state (it may wait for the
  compute of loads it released: that bounds the device memory in flight, counted in ``most_in_flight``).

A tiny Llama is captured once with ``torch.compile``; its weights are ghosts standing for records streamed
the CUDA ways (``COPIED`` from host tensors, ``STAGED`` from a safetensors file), and the real planner,
``CudaLoader`` and ``GraphRunner`` run it with the fake, as ``Engine`` wires them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fxoffload_hf.capture import HANDLE_ATTR, GhostHandle, make_ghost
from fxoffload_hf.graphs import graph_facts
from fxoffload_hf.loaders import CudaLoader, InlineReader, Loaded, Loader, ThreadedReader, Way, way_of
from fxoffload_hf.memory_model import MemoryModel
from fxoffload_hf.planner import GraphInput, GraphSchedule, partition_for_budget, plan_model
from fxoffload_hf.program import Program, build_program
from fxoffload_hf.runner import GraphRunner
from fxoffload_hf.safetensors_io import read_header
from fxoffload_hf.staging import StagingArena
from fxoffload_hf.weight_record import WeightRecord
from fxoffload_hf.weights import WeightStore

CALLS = 3  # the first call warms up; the later ones are the steady state


@dataclass(frozen=True)
class FakeEvent:
    seq: int  # copy events are numbered in issue order on the one side stream
    computed: bool = False  # an event on the compute stream, after the copies up to ``seq``


@dataclass
class _Copy:
    seq: int
    source: torch.Tensor
    snapshot: torch.Tensor  # the source's values when the copy was issued
    dest: torch.Tensor
    span: tuple[int, int] | None  # the bytes of the staging arena it reads, if any
    done: bool = False


class FakeCudaOps:
    """``DeviceOps`` with asynchronous copies on CPU tensors that checks the happens-before edges."""

    def __init__(self, arena: StagingArena) -> None:
        self.arena = arena
        self.compute_thread = threading.get_ident()
        self.steady = False  # set after the warm-up call
        self.log: list[tuple[str, int, int]] = []  # (operation, event, thread)
        self.violations: list[tuple[str, str]] = []  # (kind, what happened)
        self.events = 0
        self._copies: list[_Copy] = []  # not yet known done by the host, in issue order
        self._host_upto = 0  # the side stream is FIFO: the host knows every copy up to this event done
        self._computed_waits = 0  # compute events the host waited for: loads whose device memory is free
        self.most_in_flight = 0  # loads copied in and not known computed, at most
        self._compute_upto = 0  # the compute stream is ordered after every copy up to this event
        self._lock = threading.Lock()

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        with self._lock:
            self.events += 1
            seq = self.events
            self._note("copy_in", seq)
            out, new = {}, []
            for name, source in tensors.items():
                span = self._staged_span(source)
                for old in self._copies:
                    if span and old.span and span[0] < old.span[1] and old.span[0] < span[1]:
                        self._violate(
                            "overwrite",
                            f"staging bytes of {name} (copy #{seq}) were rewritten while copy #{old.seq}, not "
                            "known done by the host, reads them",
                        )
                dest = torch.empty_like(source, memory_format=torch.contiguous_format)
                dest.fill_(float("nan") if dest.is_floating_point() else 0x5A)
                dest._fake_copy = seq  # type: ignore[attr-defined]
                new.append(_Copy(seq, source, source.clone(), dest, span))
                out[name] = dest
            self._copies.extend(new)
            self.most_in_flight = max(self.most_in_flight, seq - self._computed_waits)
            return out, FakeEvent(seq)

    def computed(self) -> FakeEvent:
        with self._lock:
            self._note("computed", self._compute_upto)
            return FakeEvent(self._compute_upto, computed=True)

    def wait_computed(self, event: FakeEvent) -> None:
        with self._lock:
            assert event.computed
            self._note("wait_computed", event.seq)
            self._computed_waits += 1
            self._host_upto = max(self._host_upto, event.seq)  # that compute read the copies before it
            self._copies = [c for c in self._copies if c.seq > self._host_upto]

    def host_wait(self, event: FakeEvent) -> None:
        with self._lock:
            assert not event.computed
            self._note("host_wait", event.seq)
            if self.steady and threading.get_ident() == self.compute_thread:
                self._violate("host-block", f"the calling thread waited for copy #{event.seq}")
            self._run_upto(event.seq)
            self._host_upto = max(self._host_upto, event.seq)
            self._copies = [c for c in self._copies if c.seq > self._host_upto]

    def order_after(self, event: FakeEvent, tensors: dict[str, torch.Tensor]) -> None:
        with self._lock:
            self._note("order_after", event.seq)
            self._run_upto(event.seq)
            self._compute_upto = max(self._compute_upto, event.seq)

    def check_ready(self, tensors: dict[str, torch.Tensor]) -> None:
        """What ``ready`` returned is about to be computed with: each copy must be ordered before it."""
        with self._lock:
            for name, tensor in tensors.items():
                seq = getattr(tensor, "_fake_copy", 0)
                if seq > self._compute_upto:
                    self._violate(
                        "unordered", f"{name} used before the compute stream waited for copy #{seq}"
                    )

    def ops(self, seq: int) -> list[tuple[str, bool]]:
        """The operations on event ``seq`` in order, each with whether the calling thread made it."""
        copies = ("copy_in", "host_wait", "order_after")
        return [
            (op, thread == self.compute_thread) for op, s, thread in self.log if s == seq and op in copies
        ]

    def _staged_span(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        if not self.arena.capacity:
            return None
        if tensor.untyped_storage().data_ptr() != self.arena.buffer.untyped_storage().data_ptr():
            return None
        return tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()

    def _run_upto(self, seq: int) -> None:
        for copy in self._copies:
            if copy.seq <= seq and not copy.done:
                if not torch.equal(copy.source, copy.snapshot):
                    self._violate("overwrite", f"the source of copy #{copy.seq} changed before it ran")
                copy.dest.copy_(copy.source)
                copy.done = True

    def _note(self, op: str, seq: int) -> None:
        self.log.append((op, seq, threading.get_ident()))

    def _violate(self, kind: str, what: str) -> None:
        self.violations.append((kind, what))


@dataclass
class Captured:
    """A tiny Llama captured once, its weights in a store, and the program its graph is cut into."""

    compiled: Callable[..., Any]
    x: torch.Tensor
    expected: torch.Tensor
    store: WeightStore
    program: Program
    graph: GraphInput
    activations: int
    memory: MemoryModel
    run: list[Callable[..., Any]]  # run[0]: what the compiled graph calls


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Captured]:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config).eval()
    x = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x).logits
    params = dict(model.named_parameters())
    path = tmp_path_factory.mktemp("weights") / "w.safetensors"
    save_file({n: p.detach().contiguous() for n, p in params.items()}, path)
    slices = read_header(path)
    store = WeightStore(torch.device("cpu"))
    for i, (name, param) in enumerate(params.items()):
        shape, dtype = tuple(param.shape), param.dtype
        store.records[name] = (  # every third weight copied from host memory, the others staged
            WeightRecord(name, shape, dtype, host=param.detach().clone())
            if i % 3 == 2
            else WeightRecord(name, shape, dtype, disk=slices[name])
        )
        ghost = make_ghost(shape, dtype, torch.device("cpu"))
        setattr(ghost, HANDLE_ATTR, GhostHandle(store, store.records[name]))
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = ghost
    graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []
    run: list[Callable[..., Any]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append((gm, example_inputs))
        run.append(gm)
        return lambda *args: run[0](*args)

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        compiled(x)
    assert len(graphs) == 1
    gm, example_inputs = graphs[0]
    facts = graph_facts(gm, example_inputs)
    memory = MemoryModel(facts.activation_bytes + sum(facts.weight_bytes.values()) // 3)
    partition = partition_for_budget(
        gm.graph, facts.weight_bytes, facts.activation_bytes, memory, "sequential"
    )
    program = build_program(gm, partition, facts, None)
    graph = GraphInput(program.piece_names, facts.lookups)
    # the scenario to check: several pieces, weights both copied from host memory and staged from the file
    assert {way_of(r, "cuda") for r in store.records.values()} == {Way.COPIED, Way.STAGED}
    assert program.pieces >= 4
    yield Captured(compiled, x, expected, store, program, graph, facts.activation_bytes, memory, run)
    torch.compiler.reset()


def host_only(cap: Captured) -> dict[str, WeightRecord]:
    """The captured model's weights, every one in host memory (``COPIED``): no file is read."""
    return {
        name: WeightRecord(name, r.shape, r.dtype, host=r.host if r.host is not None else cap.store.read(r))
        for name, r in cap.store.records.items()
    }


@dataclass
class Run:
    ops: FakeCudaOps
    outputs: list[torch.Tensor]
    loads: int  # loads of one call
    schedule: GraphSchedule


def run_offloaded(
    cap: Captured,
    loader_cls: type[CudaLoader] = CudaLoader,
    distance: int | None = None,
    inline: bool = False,
    records: dict[str, WeightRecord] | None = None,
    runner_cls: type[GraphRunner] = GraphRunner,
) -> Run:
    """``CALLS`` calls of the captured model through ``loader_cls`` and the fake, as ``Engine`` runs a
    graph (loads ``distance`` ahead if given, on the calling thread if ``inline``, of ``records`` if given
    instead of the store's)."""
    arena = StagingArena(pin=False)
    ops = FakeCudaOps(arena)
    loader = loader_cls(cap.store, arena, ops)
    ready = loader.ready

    def checked_ready(loaded: Loaded) -> dict[str, torch.Tensor]:
        tensors = ready(loaded)
        ops.check_ready(tensors)
        return tensors

    loader.ready = checked_ready  # type: ignore[method-assign]
    threaded = ThreadedReader()
    plan = plan_model(
        [cap.graph], records or cap.store.records, version=0, memory=cap.memory, activations=cap.activations,
        device_type=loader.device_type, policy="sequential", threaded=threaded, inline=InlineReader(),
    )  # fmt: skip
    arena.resize(plan.arena_bytes)
    schedule = plan.graphs[0].ahead
    if distance is not None:
        schedule = dataclasses.replace(schedule, distance=distance)
    if inline:
        schedule = dataclasses.replace(schedule, reader=InlineReader())
    if records is None:
        staged_sides = [load.side for load in schedule.loads if load is not None and load.staged]
        assert staged_sides.count(0) >= 2 and 1 in staged_sides, "the arena's two sides must both be reused"
    cap.run[0] = runner_cls(cap.program, loader, schedule, 0)
    outputs = []
    try:
        with torch.no_grad():
            for _ in range(CALLS):
                outputs.append(cap.compiled(cap.x).logits)
                ops.steady = True
    finally:
        threaded.close()
        loader.close()
    return Run(ops, outputs, sum(load is not None for load in schedule.loads), schedule)


def checked(run: Run, cap: Captured, reader: type) -> FakeCudaOps:
    """What every run must show: the reader the plan chose, eager's results, no violation, one copy event
    per load, and no more loads holding device memory than are loaded ahead."""
    ops = run.ops
    assert isinstance(run.schedule.reader, reader)
    assert all(torch.equal(out, cap.expected) for out in run.outputs)
    assert ops.violations == []
    assert ops.events == CALLS * run.loads
    assert ops.most_in_flight <= run.schedule.distance + 1
    return ops


@pytest.mark.parametrize("distance", [None, 3])
def test_cuda_loader_orders_every_copy(captured: Captured, distance: int | None) -> None:
    """The real ``CudaLoader`` and ``GraphRunner``: eager's results bit for bit at the plan's distance (1)
    and further ahead; each copy waited for by the read-ahead thread before its staging bytes are reused,
    and ordered before the compute that reads it (loads with nothing staged are not waited for); the
    calling thread never waits for copies; no more loads hold device memory than are loaded ahead."""
    run = run_offloaded(captured, distance=distance)
    ops = checked(run, captured, ThreadedReader)
    specs = [load for load in run.schedule.loads if load is not None]
    for seq in range(1, ops.events + 1):
        # copy_in -> host_wait on the read-ahead thread where staged bytes must outlive the copy ->
        # order_after on the calling thread
        waits = [("host_wait", False)] if specs[(seq - 1) % len(specs)].staged else []
        assert ops.ops(seq) == [("copy_in", False), *waits, ("order_after", True)]


@pytest.mark.parametrize("distance", [None, 3])
def test_loads_from_host_memory_are_queued_by_the_calling_thread(
    captured: Captured, distance: int | None
) -> None:
    """No file read (every weight in host memory): the plan queues the copies from the calling thread, which
    never waits for one, only for the compute of the loads it released, so that at most ``distance`` + 1
    loads hold device memory; eager's results bit for bit."""
    run = run_offloaded(captured, distance=distance, records=host_only(captured))
    ops = checked(run, captured, InlineReader)
    for seq in range(1, ops.events + 1):
        assert ops.ops(seq) == [("copy_in", True), ("order_after", True)]


class RunsInBlocksOfThree(GraphRunner):
    """Each call run as a block of three (``run_block``), as ``cohort`` runs calls waiting at a graph."""

    def __call__(self, *args: Any) -> Any:
        first, *others = self.run_block([args, args, args])
        leaves = torch.utils._pytree.tree_leaves(first)
        for other in others:  # each call of the block computes what the first does
            assert all(
                torch.equal(a, b) for a, b in zip(leaves, torch.utils._pytree.tree_leaves(other), strict=True)
            )
        return first


def test_a_block_loads_each_piece_once_and_orders_every_copy(captured: Captured) -> None:
    """Three calls run as one block: one copy event per load (not three), each ordered before the
    compute of every call that reads it, eager's results for every call."""
    run = run_offloaded(captured, runner_cls=RunsInBlocksOfThree)
    checked(run, captured, ThreadedReader)


class ForgetsReleasedLoads(CudaLoader):
    """Mutation: the host never waits for the compute of released loads, so nothing bounds the device
    memory that queued copies take."""

    def release(self, loaded: Loaded) -> None:
        Loader.release(self, loaded)


def test_fake_catches_unbounded_device_memory(captured: Captured) -> None:
    run = run_offloaded(captured, ForgetsReleasedLoads, records=host_only(captured))
    assert run.ops.most_in_flight == run.ops.events > run.schedule.distance + 1


class SkipsHostWait(CudaLoader):
    """Mutation: the next read may overwrite staged bytes before the copy read them."""

    def to_device(self, tensors: dict[str, torch.Tensor], wait: bool) -> tuple[dict[str, torch.Tensor], Any]:
        return self.ops.copy_in(tensors)


class SkipsOrderAfter(CudaLoader):
    """Mutation: the compute stream is not ordered after the copies it reads."""

    def ready(self, loaded: Loaded) -> dict[str, torch.Tensor]:
        return loaded.tensors


class WaitsInReady(CudaLoader):
    """Mutation: the calling thread blocks on the copies before each piece."""

    def ready(self, loaded: Loaded) -> dict[str, torch.Tensor]:
        self.ops.host_wait(loaded.event)
        return super().ready(loaded)


@pytest.mark.parametrize(
    ("loader_cls", "kind"),
    [(SkipsHostWait, "overwrite"), (SkipsOrderAfter, "unordered"), (WaitsInReady, "host-block")],
)
def test_fake_catches_ordering_bugs(captured: Captured, loader_cls: type[CudaLoader], kind: str) -> None:
    """Each broken loader is caught, as that kind of violation only, at the plan's distance (1)."""
    ops = run_offloaded(captured, loader_cls).ops
    assert ops.violations, f"{loader_cls.__name__} went unnoticed"
    assert {k for k, _ in ops.violations} == {kind}


def test_overwritten_staging_changes_results(captured: Captured) -> None:
    """Loading three ahead without the host waiting, staged bytes are rewritten before their copies ran:
    the fake sees the changed sources, and the results are no longer eager's. (Loads run on the calling
    thread here, so that the reads are always ahead of the copies.)"""
    run = run_offloaded(captured, SkipsHostWait, distance=3, inline=True)
    assert any("changed before it ran" in what for _, what in run.ops.violations)
    assert not all(torch.equal(out, captured.expected) for out in run.outputs)


class NamingFakeOps(FakeCudaOps):
    """The fake, also noting the name of every weight it is asked to copy."""

    def __init__(self, arena: StagingArena) -> None:
        super().__init__(arena)
        self.copied: set[str] = set()

    def copy_in(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        self.copied.update(tensors)
        return super().copy_in(tensors)


def test_the_engine_on_cuda_gathers_embedding_rows_and_tiles_the_output_head(
    tmp_path, monkeypatch, save_checkpoint
) -> None:
    """The whole engine planning for CUDA (its loader on the fake): a vocabulary large against the hidden
    size (32,000 against 256) at 8% of the weights. The token table never reaches the device (its lookups
    gather rows where it lies, ``row_lookups``); the output head streams in tiles computed alone
    (``tiles.tile_linear_alone``); greedy tokens and every loaded copy's ordering as on CUDA."""
    import fxoffload_hf
    from fxoffload_hf import engine as engine_module
    from fxoffload_hf import tiles

    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    fakes: list[NamingFakeOps] = []

    def fake_loader(store: WeightStore, device: torch.device, ops: Any = None) -> CudaLoader:
        arena = StagingArena(pin=False)
        fakes.append(NamingFakeOps(arena))
        return CudaLoader(store, arena, fakes[-1])

    monkeypatch.setattr(engine_module, "make_loader", fake_loader)
    ran_alone = []
    monkeypatch.setattr(tiles, "tile_linear_alone", _counting(tiles.tile_linear_alone, ran_alone))
    ids = torch.randint(1, 32000, (1, 12), generator=torch.Generator().manual_seed(1))
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
        expected_logits = eager(ids).logits
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    model = fxoffload_hf.from_pretrained(tmp_path, offload="fx", cpu_memory=int(weights * 0.08))
    try:
        with torch.no_grad():
            got = model.generate(ids, **greedy)
            logits = model(ids).logits
        (ops,) = fakes
        assert torch.equal(got, expected)
        torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
        store = fxoffload_hf.engine_of(model).store
        assert "model.embed_tokens.weight" not in ops.copied
        assert any(store.records[name].tile_of == "lm_head.weight" for name in ops.copied)
        assert "lm_head.weight" not in ops.copied and ran_alone
        assert ops.violations == []
    finally:
        fxoffload_hf.restore(model)


def _counting(fn: Callable[..., Any], calls: list[int]) -> Callable[..., Any]:
    def counted(*args: Any) -> Any:
        calls.append(1)
        return fn(*args)

    return counted
