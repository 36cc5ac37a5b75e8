"""Eager calls' read-ahead: the next module's pages faulted in on a thread of their own while one computes.

Eager calls (deferred capture's) lend each module its weights in turn, in an order that repeats (decode
steps, batches). Where pages are dropped after each use (under a memory limit) the kernel's own read-ahead
does not serve (``WeightStore.read_ahead``): each module's pages would be read only when its call begins,
the disk and the compute by turns. Where the budget leaves room for the next module's pages beside those of
the module lent now (``Deferral.in_flight_room``), the module that followed last time (on a first call,
the one declared next: ``CallOrder``) has its pages faulted in and held (as a piece in flight is) on a
reader thread while the current one computes; its call then finds them in. A prediction that misses, and
the one pending when the entry call ends, is let go.
"""

from __future__ import annotations

import weakref
from concurrent.futures import Future, ThreadPoolExecutor

from torch import nn

from fxoffload_hf.mapped_io import UNIT_BYTES, MappedFiles, MappedGroup


class CallOrder:
    """The order modules are lent weights in, learnt as calls run: which module is expected after one."""

    def __init__(self, declared: list[nn.Module]) -> None:
        self._next: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
        self._previous: weakref.ReferenceType[nn.Module] | None = None
        # before a call has shown what follows a module: the one declared after it
        self._declared_next = dict(zip(declared, declared[1:], strict=False))

    def after(self, module: nn.Module) -> nn.Module | None:
        """Note that ``module`` is lent weights now, after the module lent them before it; the module that
        followed it last time (eager calls repeat their order: decode steps, batches) or, before any call
        has followed it, the module after it in the model's order (a first call: layers run in the order
        they are declared, in every Transformers model read)."""
        previous = self._previous() if self._previous is not None else None
        if previous is not None and previous is not module:
            self._next[previous] = module
        self._previous = weakref.ref(module)
        learnt = self._next.get(module)
        return learnt if learnt is not None else self._declared_next.get(module)


class ReadAhead:
    """At most one module's pages faulted in ahead of its eager call."""

    def __init__(self, files: MappedFiles, drop_cache: bool) -> None:
        self.files = files
        self.drop_cache = drop_cache
        # bytes the modules lent at once may hold (the one computing and the one read ahead); 0: none is
        # read ahead, None: no limit. Set around a deferred call (``entries``), 0 outside it.
        self.room: int | None = 0
        self.served = 0  # calls that found their pages read ahead, over the model's life
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[weakref.ReferenceType[nn.Module], MappedGroup, Future[None]] | None = None

    def wanted(self) -> bool:
        """Whether a read ahead may start now (room was set, and none is pending)."""
        return self.room != 0 and self._pending is None

    def start(self, module: nn.Module, group: MappedGroup, lent_now: int) -> bool:
        """Fault ``group`` (``module``'s next call's pages) in on the reader thread, where its 2 MiB units
        fit beside ``lent_now`` bytes lent to the module computing; whether it started."""
        if not self.wanted():
            return False
        if self.room is not None and lent_now + len(set(group.units)) * UNIT_BYTES > self.room:
            return False
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fxoffload-eager-read")
        self._pending = (weakref.ref(module), group, self._pool.submit(self.files.acquire, group))
        return True

    def take(self, module: nn.Module, group: MappedGroup) -> bool:
        """Whether ``group`` is held for ``module``'s call now, read ahead (the caller releases it as its
        own); a pending read of another module's pages is let go."""
        pending = self._pending
        if pending is None:
            return False
        owner, held, done = pending
        failed = done.exception() is not None  # waits; a failed read is retried (and raised) by the caller
        if not failed and owner() is module and held is group:
            self._pending = None
            self.served += 1
            return True
        self._let_go()
        return False

    def stop(self) -> None:
        """Let go of a pending read and its thread; nothing is read ahead until ``room`` is set again."""
        self._let_go()
        self.room = 0
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _let_go(self) -> None:
        """Give back the pending read's hold once it finished (its units are held before its pages are read,
        so a failed read gives them back too)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[2].exception()  # waits
            self.files.release_groups([pending[1]], self.drop_cache)
