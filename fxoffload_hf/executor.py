"""The executor: runs one captured graph piece by piece, each piece's weights loaded ahead of it.

Built once per captured graph: weight placeholders are found from their ghost handles, the graph is
partitioned and split (``torch.fx.passes.split_module``), and the top-level graph is turned into a
list of steps. The first call profiles (copy and compute seconds per piece) and hands the profile to
the engine's scheduler; later calls run the same steps without any mode flags.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from fxoffload_hf.capture import capture_device, handle_of, retarget_devices
from fxoffload_hf.integrations.piece_compilers import compile_piece
from fxoffload_hf.partition import Partition
from fxoffload_hf.schedule import PieceProfile
from fxoffload_hf.transfer import LoadedPiece
from fxoffload_hf.weights import WeightRecord

if TYPE_CHECKING:
    from fxoffload_hf.engine import Engine


class PieceError(RuntimeError):
    """An exception raised inside a piece, re-raised with the piece's name."""


@dataclass
class Step:
    """One top-level node of the split graph."""

    node: fx.Node
    piece: int | None  # position among the pieces in execution order, or None
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    frees: tuple[fx.Node, ...]
    weights: tuple[str | None, ...] = ()  # for each argument of a piece, the weight it is, or None


@dataclass
class PieceTiming:
    piece: int
    copy_start: float
    copy_end: float
    compute_start: float
    compute_end: float


def activation_peak(graph: fx.Graph, weight_nodes: set[fx.Node]) -> int:
    """Peak bytes of live intermediates when ``graph`` runs in order (from fake example values)."""
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for dep in node._input_nodes:
            last_use[dep] = node
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        frees.setdefault(user, []).append(value)
    live, peak = 0, 0
    sizes: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op not in ("placeholder", "output", "get_attr") and node not in weight_nodes:
            sizes[node] = _value_bytes(node.meta.get("example_value", node.meta.get("val")))
            live += sizes[node]
            peak = max(peak, live)
        for value in frees.get(node, ()):
            live -= sizes.pop(value, 0)
    return peak


def _value_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        numel = 1
        for dim in value.shape:
            numel *= _hint(dim)
        return numel * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_value_bytes(v) for v in value)
    return 0


def _hint(dim: Any) -> int:
    if isinstance(dim, int):
        return dim
    node = getattr(dim, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else 1


@dataclass
class TraceEvent:
    """One piece run, for timelines: which graph and call, bytes streamed, and its timing."""

    graph: int
    call: int
    streamed_bytes: int
    timing: PieceTiming


# loads run inline when the last call's loads took less than this share of its compute: 5% to start
# loading inline, 20% to go back to the read-ahead thread
_INLINE_SHARE = {False: 0.05, True: 0.2}

_LOOKUPS = {
    # op: position of the table among its arguments
    torch.nn.functional.embedding: 1,
    torch.embedding: 0,
    torch.ops.aten.embedding.default: 0,
}


def _only_row_lookups(weight: fx.Node) -> bool:
    """Whether the graph uses ``weight`` only as the table of embedding lookups (it reads some rows)."""
    users = list(weight.users)
    return bool(users) and all(
        user.op == "call_function"
        and user.target in _LOOKUPS
        and len(user.args) > _LOOKUPS[user.target]
        and user.args[_LOOKUPS[user.target]] is weight
        for user in users
    )


def _drop_meta(split: fx.GraphModule) -> None:
    """Free the fake example values the split graphs carry: running them needs none."""
    for module in [split, *split.children()]:
        if isinstance(module, fx.GraphModule):
            for node in module.graph.nodes:
                node.meta = {}


def _result(pending: Future[LoadedPiece]) -> LoadedPiece:
    """Wait for a read, waking often enough that Ctrl-C is not held up until the read ends."""
    while True:
        try:
            return pending.result(timeout=0.1)
        except TimeoutError:
            continue


class GraphExecutor:
    """Runs one captured graph within the engine's budget."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], engine: Engine) -> None:
        self.engine = engine
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.weight_args: dict[fx.Node, int] = {}
        weight_bytes: dict[fx.Node, int] = {}
        names: dict[fx.Node, str] = {}
        for index, (node, value) in enumerate(zip(placeholders, example_inputs, strict=False)):
            handle = handle_of(value)
            if handle is not None:
                self.weight_args[node] = index
                weight_bytes[node] = handle.record.footprint
                names[node] = handle.record.name
        traced_on = capture_device(example_inputs)
        if traced_on is not None and traced_on != engine.device:
            retarget_devices(gm.graph, traced_on, engine.device)
            gm.recompile()
        self.activation_bytes = activation_peak(gm.graph, set(weight_bytes))
        self.lookups = frozenset(names[w] for w in weight_bytes if _only_row_lookups(w))
        self.partition: Partition = engine.partition(gm.graph, weight_bytes, self.activation_bytes)
        self.split = self._split(gm)
        steps, piece_weights = self._build_steps(placeholders, names)
        self.steps = steps
        self.piece_names = [tuple(names[w] for w in ws) for ws in piece_weights]
        self.distance = 1  # pieces loaded ahead of the one computing; the schedule may raise it
        self.inline_loads = False  # load each piece just before it runs, on the calling thread
        # when loads are inline: for each piece, one past the last piece loaded with it (set by the engine)
        self.group_ends: list[int] = []
        self.piece_bytes = [sum(weight_bytes[w] for w in ws) for ws in piece_weights]
        # at run time weights are found by argument position: keep no reference to the captured graph
        self.piece_weight_args = [[self.weight_args[w] for w in ws] for ws in piece_weights]
        self.weight_sizes = {names[w]: weight_bytes[w] for w in weight_bytes}
        self.partition.forget_nodes()
        del self.weight_args
        _drop_meta(self.split)
        self.timings: list[PieceTiming] = []
        self.profile: list[PieceProfile] = []
        self._call: Callable[[tuple[Any, ...]], Any] = self._profiled_call
        self.index = len(engine.executors)
        engine.register(self)

    # -- building -------------------------------------------------------------------------------
    def _split(self, gm: fx.GraphModule) -> fx.GraphModule:
        piece_of = self.partition.piece_of()
        if len(self.partition.pieces) <= 1:
            return split_module(gm, gm, lambda n: 0)
        return split_module(gm, gm, lambda n: piece_of[n])

    def _build_steps(
        self, placeholders: list[fx.Node], names: dict[fx.Node, str]
    ) -> tuple[list[Step], list[list[fx.Node]]]:
        """Top-level nodes as steps; for each piece (in execution order) its weight placeholders."""
        original = {n.name: n for n in placeholders}
        top_placeholders = [n for n in self.split.graph.nodes if n.op == "placeholder"]
        self.arg_index = {n: i for i, n in enumerate(top_placeholders)}
        weight_top = {n for n in top_placeholders if original.get(n.name) in self.weight_args}
        self.weight_top = weight_top
        last_use: dict[fx.Node, fx.Node] = {}
        for node in self.split.graph.nodes:
            for dep in node._input_nodes:
                last_use[dep] = node
        frees: dict[fx.Node, list[fx.Node]] = {}
        for value, user in last_use.items():
            if value not in weight_top:
                frees.setdefault(user, []).append(value)
        steps: list[Step] = []
        piece_weights: list[list[fx.Node]] = []
        for node in self.split.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            piece = None
            weights: tuple[str | None, ...] = ()
            if node.op == "call_module":
                piece = len(piece_weights)
                piece_weights.append([original[a.name] for a in node.args if a in weight_top])
                weights = tuple(names[original[a.name]] if a in weight_top else None for a in node.args)
                fn = compile_piece(getattr(self.split, node.target), self.engine.config.compile)
            elif node.op == "call_function":
                fn = node.target
            else:
                raise NotImplementedError(f"unexpected top-level node {node.op} in split graph")
            steps.append(Step(node, piece, fn, tuple(node.args), tuple(frees.get(node, ())), weights))
        self.output_node = next(n for n in self.split.graph.nodes if n.op == "output")
        return steps, piece_weights

    # -- running --------------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        return self._call(args)

    @staticmethod
    def _record(args: tuple[Any, ...], position: int) -> WeightRecord:
        """The stored weight whose ghost was passed at ``position`` in this call."""
        handle = handle_of(args[position])
        assert handle is not None, "a weight argument lost its ghost handle"
        return handle.record

    def _records(self, args: tuple[Any, ...], piece: int) -> list[WeightRecord]:
        return [self._record(args, i) for i in self.piece_weight_args[piece]]

    def _run(self, args: tuple[Any, ...], profile: bool) -> Any:
        engine = self.engine
        copy = engine.copy
        env: dict[fx.Node, Any] = {}
        for node, index in self.arg_index.items():
            if node not in self.weight_top:
                env[node] = args[index]
        pieces = len(self.piece_weight_args)
        inline = self.inline_loads
        # more than one piece ahead only where no piece is staged: the arena holds two pieces, not more
        distance = 0 if inline else self.distance if copy.arena.capacity == 0 else 1
        group_ends = self.group_ends if inline and len(self.group_ends) == pieces else None
        ahead: deque[Future[LoadedPiece]] = deque()
        submitted = 0
        loaded, loaded_until = LoadedPiece({}, 0.0, 0.0, 0), 0  # the load in use; one past its last piece

        def load_ahead(upto: int) -> None:
            nonlocal submitted
            while submitted < min(upto, pieces):
                end = group_ends[submitted] if group_ends else submitted + 1
                records = [r for piece in range(submitted, end) for r in self._records(args, piece)]
                ahead.append(copy.submit(records, submitted % 2, self.lookups, inline=inline))
                submitted = end

        wait_seconds = copy_seconds = compute_seconds = 0.0
        try:
            for step in self.steps:
                if step.piece is None:
                    env[step.node] = step.fn(*[env[a] if isinstance(a, fx.Node) else a for a in step.args])
                else:
                    if step.piece < loaded_until:  # loaded together with the piece before
                        loaded = LoadedPiece(
                            loaded.tensors, time.perf_counter(), 0.0, 0, mapped=loaded.mapped
                        )
                        weights = loaded.tensors
                    else:
                        load_ahead(step.piece + 1)
                        waited = time.perf_counter()
                        loaded = _result(ahead.popleft())
                        wait_seconds += time.perf_counter() - waited
                        weights = copy.ready(loaded)
                        loaded_until = group_ends[step.piece] if group_ends else step.piece + 1
                        load_ahead(step.piece + 1 + distance)
                    call_args = [
                        weights[name] if name is not None else env[a] if isinstance(a, fx.Node) else a
                        for a, name in zip(step.args, step.weights, strict=True)
                    ]
                    start = time.perf_counter()
                    ran = False
                    try:
                        result = step.fn(*call_args)
                        ran = True
                    except Exception as exc:
                        raise PieceError(
                            f"piece {step.piece} ({step.node.target}) of a graph offloaded by fxoffload_hf failed: {exc}"
                        ) from exc
                    finally:
                        del call_args
                        if step.piece + 1 == loaded_until or not ran:  # the last piece of its load, or failed
                            copy.release(loaded)
                    if profile and engine.device.type == "cuda":
                        torch.cuda.synchronize(engine.device)
                    end = time.perf_counter()
                    if loaded.streamed_bytes and engine.device.type == "cpu":
                        result = copy.detach_from_arena(result)
                    env[step.node] = result
                    del weights
                    engine.stats.add_piece(loaded.streamed_bytes, loaded.seconds)
                    copy_seconds += loaded.seconds
                    compute_seconds += end - start
                    timing = PieceTiming(
                        step.piece, loaded.started, loaded.started + loaded.seconds, start, end
                    )
                    if profile:
                        self.timings.append(timing)
                    if engine.trace is not None:
                        engine.trace.append(
                            TraceEvent(self.index, engine.stats.calls, loaded.streamed_bytes, timing)
                        )
                for value in step.frees:
                    env.pop(value, None)
        except BaseException:
            # leave the staging arena quiet: an unfinished read must not land in the next call's piece
            wait(ahead)
            raise
        finally:
            copy.flush(inline=inline)
        engine.stats.add_call(wait_seconds)
        # On the CPU, when the pages are cached, loading a piece is far quicker than computing one; a
        # read-ahead thread then only costs the compute: each wake-up takes a core from its threads.
        share = _INLINE_SHARE[self.inline_loads]  # a margin either way, so the choice does not flicker
        self.inline_loads = engine.device.type == "cpu" and copy_seconds < share * compute_seconds
        out = self.output_node.args[0]
        return fx.node.map_arg(out, lambda n: env[n] if n not in self.weight_top else args[self.arg_index[n]])

    def _profiled_call(self, args: tuple[Any, ...]) -> Any:
        self.timings = []
        result = self._run(args, profile=True)
        profiles = []
        for timing in self.timings:
            names = self.piece_names[timing.piece]
            profiles.append(
                PieceProfile(
                    weights=names,
                    weight_bytes={n: self.weight_sizes[n] for n in names},
                    copy_seconds=timing.copy_end - timing.copy_start,
                    compute_seconds=timing.compute_end - timing.compute_start,
                )
            )
        self.profile = profiles
        self.engine.schedule(self)
        self._call = self._steady_call
        return result

    def _steady_call(self, args: tuple[Any, ...]) -> Any:
        return self._run(args, profile=False)
