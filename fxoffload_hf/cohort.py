"""Several calls of one offloaded model run as a block: each streamed weight serves all of them.

Every call (a member) runs in a thread of its own, but only one runs at a time, in turn, so the model's
Python code never runs concurrently and nothing in it needs to be thread-safe. A member that reaches a
captured graph waits there. When every member waits or has finished, the coordinator (the thread that
started the block) runs the graph that most members wait at once for all of them, or as many as fit the
budget together (``GraphRunner.run_block``: each piece loads once and computes for every member before the
next loads), hands each member its own result, and lets those go on in their order before it serves the
rest. Each member computes exactly what it computes alone; only the
order of the work changes, so results are bit-identical to calls made one after the other.

Per-member state outside the model (``member_state``: attributes such as a loop's current batch
indices) is saved when a member stops at a graph and put back when it goes on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")

# the coordinator wakes this often while it waits, so that Ctrl-C is not held up
_POLL_SECONDS = 0.1


class Gate(Protocol):
    """A captured graph's entry, as the coordinator runs it for a group of members."""

    def call_together(self, calls: list[tuple[Any, ...]], held: int) -> list[Any]:
        """Run the graph for the first of ``calls``, as many as fit beside ``held`` bytes of calls waiting
        elsewhere: their results."""
        ...

    def input_bytes(self, calls: list[tuple[Any, ...]]) -> int:
        """Bytes of the tensors ``calls`` pass of their own (what a waiting call holds)."""
        ...


class SharedLock:
    """A reentrant lock that the members of a running block pass through: the coordinator holds it for
    them all (they take turns, so they cannot race), while any other thread waits for the block to end."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._members: set[int] = set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if threading.get_ident() in self._members:
            return True
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        if threading.get_ident() not in self._members:
            self._lock.release()

    def __enter__(self) -> SharedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def admit(self, ident: int) -> None:
        self._members.add(ident)

    def dismiss(self, ident: int) -> None:
        self._members.discard(ident)


class _State(Enum):
    READY = "ready"  # may run when given the turn
    WAITING = "waiting"  # stopped at a graph
    DONE = "done"


@dataclass(eq=False)
class _Member:
    index: int
    call: Callable[[], Any]
    state: _State = _State.READY
    gate: Gate | None = None
    args: tuple[Any, ...] = ()
    modes: _ThreadModes | None = None  # the member's torch modes where it waits
    result: Any = None
    error: BaseException | None = None
    saved: list[Any] = field(default_factory=list)
    thread: threading.Thread | None = None


class _Aborted(BaseException):
    """Raised at a member's graph when the block is abandoned (the coordinator was interrupted)."""


class Cohort:
    """One block of calls (see the module docstring); ``run`` it once."""

    def __init__(self, lock: SharedLock, member_state: Sequence[tuple[object, str]] = ()) -> None:
        self._lock = lock
        self._member_state = tuple(member_state)
        self._cv = threading.Condition(threading.Lock())
        self._turn: _Member | None = None  # the member whose thread runs now; None: the coordinator
        self._by_thread: dict[int, _Member] = {}
        self._aborted = False
        self.group_sizes: list[int] = []  # members served by each graph run, in order

    def is_member(self) -> bool:
        """Whether the calling thread runs one of this block's calls."""
        return threading.get_ident() in self._by_thread

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        """Run ``calls`` as one block; their results in order. The first member's exception (in member
        order) is raised once every member has ended."""
        members = [_Member(i, call) for i, call in enumerate(calls)]
        try:
            while True:
                for member in members:
                    if member.state is _State.READY:
                        self._give_turn(member)
                waiting = [m for m in members if m.state is _State.WAITING]
                if not waiting:
                    break
                self._serve(waiting)
        except BaseException:
            self._abandon(members)
            raise
        for member in members:
            if member.error is not None:
                raise member.error
        return [m.result for m in members]

    # -- coordinator ----------------------------------------------------------------------------
    def _give_turn(self, member: _Member) -> None:
        """Let ``member`` run until it stops at a graph or ends."""
        with self._cv:
            self._turn = member
            if member.thread is None:
                member.thread = threading.Thread(
                    target=self._member_main,
                    args=(member, _ThreadModes.current()),
                    name=f"fxoffload-block-{member.index}",
                    daemon=True,
                )
                member.thread.start()
            else:
                self._cv.notify_all()
            while self._turn is not None:
                self._cv.wait(_POLL_SECONDS)

    def _serve(self, waiting: list[_Member]) -> None:
        """Run the graph the most members wait at (the earliest member's on a tie) for as many of them as
        fit together; those go on, the rest wait for the next run."""
        groups: dict[int, list[_Member]] = {}
        for member in waiting:
            groups.setdefault(id(member.gate), []).append(member)
        group = max(groups.values(), key=len)
        gate, modes = group[0].gate, group[0].modes
        assert gate is not None and modes is not None
        held = sum(m.gate.input_bytes([m.args]) for m in waiting if m.gate is not gate and m.gate is not None)
        try:
            # in the members' modes (the same for all: dynamo guards a graph on them)
            with modes.entered():
                results = gate.call_together([m.args for m in group], held)
        except Exception as exc:
            served = group
            for member in group:
                member.error, member.result = exc, None
        else:
            served = group[: len(results)]
            for member, result in zip(served, results, strict=True):
                member.result = result
        self.group_sizes.append(len(served))
        for member in served:
            member.state, member.gate, member.args, member.modes = _State.READY, None, (), None

    def _abandon(self, members: list[_Member]) -> None:
        """Interrupted: end every member (each unwinds from its graph), then let the interrupt through."""
        self._aborted = True
        for member in members:
            if member.thread is not None and member.state is not _State.DONE:
                # a second interrupt leaves the rest: members are daemon threads, they end with the process
                with contextlib.suppress(BaseException):
                    self._give_turn(member)
        self._turn = None

    # -- members --------------------------------------------------------------------------------
    def _member_main(self, member: _Member, modes: _ThreadModes) -> None:
        ident = threading.get_ident()
        self._by_thread[ident] = member
        self._lock.admit(ident)
        try:
            with modes.entered():
                member.result = member.call()
        except BaseException as exc:
            member.error = exc
        finally:
            self._lock.dismiss(ident)
            del self._by_thread[ident]
            with self._cv:
                member.state = _State.DONE
                self._turn = None
                self._cv.notify_all()

    def wait_at(self, gate: Gate, args: tuple[Any, ...]) -> Any:
        """Called in a member's thread by a graph: stop here until the graph has run for this member."""
        member = self._by_thread[threading.get_ident()]
        if self._aborted:
            raise _Aborted("the block of calls was interrupted")
        member.saved = [getattr(owner, name) for owner, name in self._member_state]
        with self._cv:
            member.state, member.gate, member.args = _State.WAITING, gate, args
            member.modes = _ThreadModes.current()
            self._turn = None
            self._cv.notify_all()
            while self._turn is not member:
                self._cv.wait()
        for (owner, name), value in zip(self._member_state, member.saved, strict=True):
            setattr(owner, name, value)
        if self._aborted:
            raise _Aborted("the block of calls was interrupted")
        error, member.error = member.error, None
        if error is not None:
            raise error
        result, member.result = member.result, None
        return result


@dataclass(frozen=True)
class _ThreadModes:
    """Torch's per-thread modes where a member runs: its thread starts in the coordinator's, and a group
    runs in its members' (dynamo guards a graph on them, and a graph traced under autocast computes under
    it only while it is on)."""

    inference: bool
    grad: bool
    autocast: tuple[tuple[str, torch.dtype], ...]  # device types with autocast on, and its dtype

    @staticmethod
    def current() -> _ThreadModes:
        autocast = tuple(
            (device, torch.get_autocast_dtype(device))
            for device in _AUTOCAST_DEVICES
            if torch.is_autocast_enabled(device)
        )
        return _ThreadModes(torch.is_inference_mode_enabled(), torch.is_grad_enabled(), autocast)

    @contextmanager
    def entered(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device in _AUTOCAST_DEVICES:
                dtype = dict(self.autocast).get(device)
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=dtype is not None))
            yield


_AUTOCAST_DEVICES = ("cpu", "cuda")
