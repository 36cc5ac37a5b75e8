"""How many torch operations an eager call runs: the size of the graph dynamo would capture for it.

A captured graph holds host memory in proportion to its nodes (``memory_model.graph_state_bytes``), and
a graph has about one node per torch function or tensor method its code calls, the eager fallback's own
lending left out (``uncounted``; 0.80 to 1.04 nodes per operation on twelve architectures:
``capture_forecast._GRAPH_NODES_PER_OP``). Counting an eager
call's operations tells, before anything is traced, whether capturing that call could fit the budget at
all (``CaptureForecast.least_to_capture``): a capture the budget then refuses would have cost its tracing
time and left host memory behind that nothing gives back (about 100 MiB after a 15-layer model's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch.overrides import TorchFunctionMode

_counting: list[OpCounter] = []  # the counters counting now on this thread's calls, innermost last


class OpCounter(TorchFunctionMode):
    """Within (``with counter:``): counts in ``ops`` every torch function and tensor method called; their
    results unchanged (each call is only passed on). Not ``active``: counts nothing and costs nothing
    (a mode on the stack costs each operation a Python call)."""

    def __init__(self, active: bool = True) -> None:
        super().__init__()
        self.active = active
        self.ops = 0
        self.paused = 0  # ``uncounted`` blocks open

    def __enter__(self) -> OpCounter:
        if self.active:
            _counting.append(self)
            super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            super().__exit__(*exc)
            _counting.remove(self)

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not self.paused:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def uncounted() -> Iterator[None]:
    """Within: operations are not counted (the eager fallback's lending of weights and its tiles, which
    a captured graph has no nodes for, or one)."""
    counter = _counting[-1] if _counting else None
    if counter is None:
        yield
        return
    counter.paused += 1
    try:
        yield
    finally:
        counter.paused -= 1
