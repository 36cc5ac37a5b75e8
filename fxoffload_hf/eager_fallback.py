"""Eager fallback: a module that holds offloaded weights but runs outside a captured graph.

Dynamo leaves a module to run eagerly when it cannot capture it (a graph break inside it, its recompile
limit reached), and users call submodules directly (``model.get_input_embeddings()(ids)``). Either way
the module's ``__call__`` runs for real, so forward hooks see it: the pre-hook gives the module's ghosts
their values for the call (read from the store, as accelerate's offload hooks do) and the post-hook
takes them back. The result is exact; the cost is a read that no prefetch hides, so each such module is
named once in a warning. Inside a captured graph the hooks do nothing: the engine feeds the weights.

A module's eager call needs its weights whole, so it is refused when they cannot fit the budget
(``BudgetTooSmallError`` naming the module), except a plain ``nn.Embedding``'s table: it is lent where it
lies, read by rows as the engine's lookups read it (on CUDA its rows gathered on the host,
``row_lookups``); and a plain ``nn.Linear``'s weight too large to lend beside another module's: its
call is computed in tiles of rows, lent one at a time (``eager_tiles``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fxoffload_hf.capture import handle_of
from fxoffload_hf.cohort import SharedLock
from fxoffload_hf.deferral import Lending
from fxoffload_hf.eager_forwards import (
    EagerForward,
    LendsAfterBreak,
    LendsToMethod,
    methods_reading_weights,
    reads_rows,
)
from fxoffload_hf.eager_groups import ModuleGroups
from fxoffload_hf.eager_ops import uncounted
from fxoffload_hf.eager_read_ahead import CallOrder, ReadAhead
from fxoffload_hf.eager_sizes import (
    lent_ghosts,
    record_of,
    tables_read_by_rows,
    weights_used_whole,
    whole_bytes,
)
from fxoffload_hf.eager_tiles import EagerTiling
from fxoffload_hf.loaders import Way, way_of
from fxoffload_hf.mapped_io import MappedGroup
from fxoffload_hf.memory_model import MemoryModel, format_bytes
from fxoffload_hf.progress import report
from fxoffload_hf.weight_rescaling import weight_write_error
from fxoffload_hf.weights import WeightStore


class EagerFallbackWarning(UserWarning):
    """A module with offloaded weights ran eagerly: exact, but its weights were read without prefetch."""


@dataclass
class _Lent:
    """What one eager call of a module was lent: each ghost with what it held before, and the mapped
    file pages its views use."""

    swapped: list[tuple[nn.Parameter, torch.Tensor]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # each ghost's version once lent: a write bumps it
    mapped: MappedGroup | None = None


class EagerWeights:
    """The forward hooks of every module that holds ghosts (see the module docstring)."""

    def __init__(
        self,
        names: Mapping[nn.Module, str],
        lock: SharedLock,
        store: WeightStore,
        memory: MemoryModel | None = None,
        borrowed: Mapping[nn.Module, list[nn.Module]] | None = None,
    ) -> None:
        self.names = dict(names)
        # per module, the children whose weights its own code reads without calling them (``direct_reads``):
        # their ghosts are lent to its calls with its own
        self.borrowed = dict(borrowed or {})
        self.lock = lock
        self.store = store
        self.memory = memory  # the budget a module's lent weights must fit
        self.warned: set[nn.Module] = set()
        self.warn = True  # off while the engine runs a call eagerly on purpose
        self.lends = 0  # module calls given weights, over the model's life
        # per module, a stack (calls may nest) of what each call was lent
        self._lent: dict[nn.Module, list[_Lent]] = {}
        self.groups = ModuleGroups(store.files)  # per module, the mapped group it was lent last
        self._order: list[nn.Module] = []  # modules holding lent weights now, innermost last (``unwind``)
        # the order modules are lent weights in: the next one's pages are read ahead while one computes
        self.order = CallOrder(list(self.names))
        # where pages are dropped after use, the next module's faulted in on a thread (deferred calls)
        self.ahead = ReadAhead(store.files, store.drop_cache)
        # ``lent_span`` per module, with what it depends on (``_span_now``)
        self._spans: dict[nn.Module, tuple[object, int]] = {}
        # projections that can be computed in tiles of rows, and whether they are now
        self.tiles = EagerTiling(self.names, store)

    def lending_in_tiles(self, room: int) -> Lending:
        """How eager calls would be lent weights with tiles sized for ``room`` bytes for weights beside a
        call (nothing changes)."""
        with self.tiles.noted_for(room):
            return self.lending(tiled=True)

    def use_tiles(self, room: int) -> Lending:
        """Compute the projections too large to lend whole beside ``room`` bytes for weights in tiles
        sized for it, from now on; how eager calls are lent weights then."""
        self.tiles.note(room)
        report(
            "eager calls compute %s in tiles of rows from now on: lent whole, it does not fit beside the call",
            ", ".join(self.tiles.described),
        )
        self.tiles.on = True
        return self.lending(tiled=True)

    def lending(self, tiled: bool) -> Lending:
        """How eager calls are lent weights, with the noted projections in tiles or whole."""
        ordered = list(self.names)  # the model's order
        if not ordered:
            return Lending()
        with self.tiles.used(tiled):
            largest = max(ordered, key=self.lent_bytes)
            return Lending(
                largest=self.lent_bytes(largest),
                largest_name=f"{type(largest).__name__} {self.names[largest]!r}",
                span=max((self.lent_span(m) for m in ordered), default=0),
                keepable=list(dict.fromkeys(name for m in ordered for name in self.used_whole(m))),
            )

    def install(self, module: nn.Module, hooks: bool = True) -> list[Any]:
        """Attach the hooks to ``module``; the removable handles. ``hooks`` False: an entry point's own
        module, whose call the entry point captures or lends to itself when it runs it eagerly
        (``lending_to``); hooks would lend around a captured call too, outside it.

        A forward that dynamo is told never to trace (``torch.compiler.disable``) would run eagerly
        after its hooks were traced (and did nothing): it is wrapped instead, in a wrapper dynamo does not
        trace either, which gives the weights around the call."""
        if getattr(module.forward, "_torchdynamo_disable", False):
            return [EagerForward(module, self)]
        weight_names = [name for name, p in module._parameters.items() if handle_of(p) is not None]
        attached = (
            [
                module.register_forward_pre_hook(self.before),
                module.register_forward_hook(self.after, always_call=True),
            ]
            if hooks
            else []
        )
        return [
            *attached,
            LendsAfterBreak(module, self),
            *(LendsToMethod(module, name, self) for name in methods_reading_weights(module, weight_names)),
        ]

    @contextmanager
    def lending_to(self, module: nn.Module) -> Iterator[None]:
        """``module``'s weights lent around an eager call its hooks leave alone (``install``)."""
        if module not in self.names:
            yield
            return
        self.before(module, ())
        try:
            yield
        finally:
            self.after(module, (), None)

    def holds(self, module: nn.Module) -> bool:
        """Whether ``module``'s ghosts hold lent values now (a call of it is running eagerly)."""
        return bool(self._lent.get(module))

    def before(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_dynamo_compiling():
            return
        with uncounted():  # lending has no node in a captured graph (``eager_ops``)
            self._lend(module)

    def _lend(self, module: nn.Module) -> None:
        # released by ``after``, which runs when the forward raises an Exception; a KeyboardInterrupt
        # skips it (torch runs always-call hooks for Exceptions only): the entry point ``unwind``s then
        self.lock.acquire()
        lent = _Lent()
        self.lends += 1
        lends_grad_flag = not torch.is_grad_enabled()
        self._lent.setdefault(module, []).append(lent)
        self._order.append(module)
        try:
            ghosts = self._ghosts(module)
            for ghost, value in zip(ghosts, self._values(module, ghosts, lent), strict=True):
                lent.swapped.append((ghost, ghost.data))
                ghost.data = value
                lent.versions.append(ghost._version)
                if lends_grad_flag:  # as the runner's weights do (``loaders.as_parameters``)
                    ghost.requires_grad_(record_of(ghost).requires_grad)
            self._read_ahead_after(module)
            if self.warn:
                self._warn_once(module)
        except BaseException:
            self._release(module)
            raise

    def _values(self, module: nn.Module, ghosts: list[nn.Parameter], lent: _Lent) -> list[torch.Tensor]:
        """The values of ``ghosts`` for one call: kept ones as they are, weights whose file bytes can
        serve as they lie (the CPU) as views of the file's pages (no copy; unmapped by ``after``, as the
        runner's loads are), the others read."""
        values: dict[int, torch.Tensor] = {}
        ways = self._ways(module, ghosts)
        self._check_fits(module, ghosts, ways)
        in_place = self._in_place(module, ghosts, ways)
        for i, (ghost, way) in enumerate(zip(ghosts, ways, strict=True)):
            record = record_of(ghost)
            if i in in_place:
                continue
            if self.tiles.tiled(module, ghost):
                values[i] = ghost.data  # computed in tiles, lent one at a time (``project``)
            elif way is Way.HELD:
                values[i] = record.resident  # type: ignore[assignment]
            elif way is Way.ROWS:
                values[i] = record.host  # type: ignore[assignment]
            else:
                values[i] = self.store.read(record).to(ghost.device, ghost.dtype)
        if in_place:
            group = self.groups.of(module, [ghosts[i] for i in in_place])
            lent.mapped = group  # before acquire: a failed page read still gives its hold back
            if not self.ahead.take(module, group):
                self.store.files.acquire(group)
            values.update(zip(in_place, group.views, strict=True))
        return [values[i] for i in range(len(ghosts))]

    def _in_place(self, module: nn.Module, ghosts: list[nn.Parameter], ways: list[Way]) -> list[int]:
        """Which of ``ghosts`` are lent as views of their file's pages (``_values``)."""
        return [
            i
            for i, (ghost, way) in enumerate(zip(ghosts, ways, strict=True))
            if way is Way.MAPPED
            and ghost.dtype == record_of(ghost).dtype
            and not self.tiles.tiled(module, ghost)
        ]

    def _ways(self, module: nn.Module, ghosts: list[nn.Parameter]) -> list[Way]:
        """How each ghost's weight comes in for an eager call, as the runner's loads bring it in (a plain
        embedding's table read by rows)."""
        return [
            way_of(record_of(g), g.device.type, rows_only=reads_rows(module, g.device.type)) for g in ghosts
        ]

    def _check_fits(self, module: nn.Module, ghosts: list[nn.Parameter], ways: list[Way]) -> None:
        """Refuse an eager call whose weights, whole, cannot fit the budget."""
        room = None if self.memory is None else self.memory.room(0)
        whole = whole_bytes(module, ghosts, ways, self.tiles.held_bytes(module))
        if room is not None and whole > room and module in self.tiles.rows:
            self.use_tiles(room)  # lent as it is, it does not fit: in tiles (smaller ones) from now on
            whole = whole_bytes(module, ghosts, ways, self.tiles.held_bytes(module))
        if room is None or whole <= room:
            return
        name = self.names.get(module, "")
        assert self.memory is not None
        raise self.memory.too_small(
            self.memory.smallest_budget(whole, 0),
            0,
            f"{type(module).__name__} {name!r} runs outside a captured graph (a graph break inside it, "
            f"deferred capture, or a direct call) and needs its weights whole: {format_bytes(whole)}",
        )

    def lent_bytes(self, module: nn.Module) -> int:
        """Bytes an eager call of ``module`` brings in whole (its table read by rows is not)."""
        ghosts = self._ghosts(module)
        return whole_bytes(module, ghosts, self._ways(module, ghosts), self.tiles.held_bytes(module))

    def lent_span(self, module: nn.Module) -> int:
        """What an eager call of ``module`` can hold mapped: its weights used in place from their files
        as the 2 MiB units of mapping they touch, each with the weights' bytes in it (a unit is mapped
        whole where the kernel keeps the file in 2 MiB folios: ``mapped_io``); the rest as ``lent_bytes``."""
        ghosts = self._ghosts(module)
        whole = [
            (r, way)
            for r, way in weights_used_whole(
                module, ghosts, self._ways(module, ghosts), self.tiles.in_tiles(module)
            )
            if way is not Way.HELD
        ]
        files = self.store.files
        units = {unit for r, way in whole if way is Way.MAPPED and r.disk for unit in files.units(r.disk)}
        mapped = files.held_bytes(units, self.store.in_place_sources()) if units else 0
        tiles = self.tiles.held_bytes(module)
        return mapped + sum(r.footprint for r, way in whole if way is not Way.MAPPED) + tiles

    def used_whole(self, module: nn.Module) -> list[str]:
        """The weights an eager call of ``module`` uses whole (not a table it reads rows of)."""
        ghosts = self._ghosts(module)
        ways = self._ways(module, ghosts)
        return [
            record.name
            for record, _way in weights_used_whole(module, ghosts, ways, self.tiles.in_tiles(module))
        ]

    def _read_ahead_after(self, module: nn.Module) -> None:
        """Read ahead the pages of the module expected to be lent weights after ``module``
        (``CallOrder``)."""
        following = self.order.after(module)
        group = self._group_ahead(following) if following is not None else None
        if following is None or group is None:
            return
        if not (self.ahead.wanted() and self.ahead.start(following, group, self._span_now(module))):
            self.store.read_ahead(group)

    def _group_ahead(self, module: nn.Module) -> MappedGroup | None:
        def in_place() -> list[nn.Parameter]:
            ghosts = self._ghosts(module)
            return [ghosts[i] for i in self._in_place(module, ghosts, self._ways(module, ghosts))]

        return self.groups.ahead(module, self.store.version, in_place)

    def _span_now(self, module: nn.Module) -> int:
        """``lent_span`` of ``module``, kept while the weights' tiers and the tiles stay as they are."""
        key = (self.store.version, self.tiles.on, self.tiles.rows.get(module))
        known = self._spans.get(module)
        if known is None or known[0] != key:
            known = self._spans[module] = (key, self.lent_span(module))
        return known[1]

    def after(self, module: nn.Module, args: Any, output: Any) -> None:
        # dynamo may trace a module's pre-hook and leave its post-hook to run eagerly (a graph break
        # inside the call): only a call whose pre-hook gave values has any to take back
        if torch.compiler.is_dynamo_compiling() or not self._lent.get(module):
            return
        with uncounted():
            written = self._release(module)
        if written:
            raise weight_write_error(written[0], "in an eager call")

    def mark(self) -> int:
        """How many lends are open now: give it to ``unwind``."""
        return len(self._order)

    def unwind(self, mark: int) -> None:
        """Take back every lend opened since ``mark`` whose ``after`` did not run (an interrupt)."""
        while len(self._order) > mark:
            self._release(self._order[-1])

    def _release(self, module: nn.Module) -> list[str]:
        """Take back what ``module``'s last call was lent; the names of the weights it wrote into."""
        written: list[str] = []
        try:
            for i in range(len(self._order) - 1, -1, -1):
                if self._order[i] is module:
                    del self._order[i]
                    break
            stack = self._lent[module]
            lent = stack.pop()
            for (ghost, _held), version in zip(lent.swapped, lent.versions, strict=False):
                if ghost._version != version:
                    written.append(record_of(ghost).name)
            for ghost, held in reversed(lent.swapped):
                ghost.data = held
                ghost.requires_grad_(False)
            if lent.mapped is not None:
                self.store.files.release_groups([lent.mapped], self.store.drop_cache)
            if not stack:
                del self._lent[module]
        finally:
            self.lock.release()
        return written

    def _ghosts(self, module: nn.Module) -> list[nn.Parameter]:
        return lent_ghosts(module, self.borrowed.get(module, ()))

    def _warn_once(self, module: nn.Module) -> None:
        """Name ``module`` once, with what its call is lent: the bytes it brings in whole, and a table it
        reads by rows where it lies, said apart (only the rows looked up are read)."""
        if module in self.warned:
            return
        self.warned.add(module)
        name = self.names.get(module, "")
        ghosts = self._ghosts(module)
        tables = tables_read_by_rows(module, ghosts, self._ways(module, ghosts))
        lent = f"its weights ({format_bytes(self.lent_bytes(module))} whole"
        if tables:
            lent += (
                f"; its table ({format_bytes(sum(r.footprint for r in tables))}) read by rows where it lies"
            )
        warnings.warn(
            f"{type(module).__name__} {name!r} ran outside a captured graph (a graph break inside it, dynamo's "
            f"recompile limit, or a direct call); {lent}) are lent "
            "to each such call outside the streamed schedule: exact, but slower. Remove the graph break "
            "(TORCH_LOGS=graph_breaks shows it) to stream them",
            EagerFallbackWarning,
            stacklevel=4,  # the module call that ran it (through before and _lend)
        )
