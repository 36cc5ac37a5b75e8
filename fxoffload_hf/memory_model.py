"""What must fit at once: the one definition of the budget rule (pure: no torch devices, no IO).

Everything the engine holds where the model computes is counted here:

    fixed (small parameters and buffers kept on the device)
  + captured graphs' state (dynamo's graphs, guards and fake values, in host memory: CPU budgets only)
  + activations (the peak of live intermediates of the largest graph), or, where larger, the room kept
    for dynamo's transient while a graph is captured (between calls: generate's decode graph after its
    prefill)
  + resident weights (kept between calls)
  + pieces in flight (``distance + 1`` consecutive streamed pieces, each laid out at aligned offsets;
    a piece that does not fit beside the one before it waits for it: the floor is the largest alone)

The partitioner, the scheduler, ``plan`` and ``offload`` all ask this module; none restates the rule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

ALIGN = 64  # tensors in a staging buffer start at multiples of this many bytes

# the free budget is split this many ways into piece targets: under "auto" two pieces in flight take a
# quarter of it and the rest can stay resident; under "sequential" two pieces take all of it
PIECE_DIVISOR = {"auto": 8, "sequential": 2}

# What each op of a captured graph leaves in host memory: dynamo's graph, guards, symbolic shapes and fake
# values, our split pieces, and the heap they fragment. Measured on Llama graphs of 1,000 to 2,900 ops
# (RssAnon after capture, less weights and arena): 18 to 22 KiB per op.
GRAPH_STATE_BYTES_PER_OP = 24 * 1024
# What each op adds where the graph is also saved in the compile cache (``compile_cache``): its bytes, its
# guards' saved state and the package holding them. Measured on the memory test's Llama (18 layers, graphs
# of 1,384 and 1,477 ops, planned alike with and without the cache): 13.6 MiB more RssAnon after capture,
# 4.9 KiB per op.
SAVED_GRAPH_BYTES_PER_OP = 6 * 1024

# the "too small" error suggests a smaller batch when activations are at least 1/this of what is needed
ACTIVATION_HINT_SHARE = 4


def nbytes(shape: Iterable[int], itemsize: int) -> int:
    """Bytes of a dense tensor of ``shape`` whose elements take ``itemsize`` bytes."""
    return math.prod(shape) * itemsize


def aligned(size: int) -> int:
    """``size`` rounded up to the staging alignment."""
    return (size + ALIGN - 1) // ALIGN * ALIGN


def piece_bytes(tensor_bytes: Iterable[int]) -> int:
    """Bytes one piece takes in flight: its tensors laid out at aligned offsets."""
    return sum(aligned(b) for b in tensor_bytes)


def window_bytes(pieces: Sequence[int], width: int, cuts: Sequence[bool] = ()) -> int:
    """The most bytes any ``width`` consecutive pieces hold together (the pieces in flight at once).

    ``cuts[i]``: piece ``i`` is loaded only once the piece before it is released (it does not fit beside
    it), so no window spans that boundary.
    """
    if not pieces:
        return 0
    width = min(max(width, 1), len(pieces))
    if not any(cuts):
        total = best = sum(pieces[:width])
        for i in range(width, len(pieces)):
            total += pieces[i] - pieces[i - width]
            best = max(best, total)
        return best
    best = 0
    for start in range(len(pieces)):
        total = pieces[start]
        for i in range(start + 1, min(start + width, len(pieces))):
            if cuts[i]:
                break
            total += pieces[i]
        best = max(best, total)
    return best


def cuts_for(pieces: Sequence[int], room: int | None) -> tuple[bool, ...]:
    """For each piece, whether it must wait for the piece before it to be released: the two do not fit
    in ``room`` together (a piece that brings nothing in never waits). Such a piece streams without
    overlap; it needs only itself to fit."""
    if room is None:
        return (False,) * len(pieces)
    return tuple(
        i > 0 and pieces[i - 1] > 0 and pieces[i] > 0 and pieces[i - 1] + pieces[i] > room
        for i in range(len(pieces))
    )


def pair_bytes(pieces: Sequence[int]) -> int:
    """Bytes two consecutive pieces hold together at most: what double buffering needs."""
    return window_bytes(pieces, 2)


def graph_state_bytes(ops: int, saved: bool = False) -> int:
    """Host memory a captured graph of ``ops`` ops holds while it lives (``GRAPH_STATE_BYTES_PER_OP``),
    ``saved`` in the compile cache as well (``SAVED_GRAPH_BYTES_PER_OP``)."""
    return ops * (GRAPH_STATE_BYTES_PER_OP + (SAVED_GRAPH_BYTES_PER_OP if saved else 0))


class BudgetTooSmallError(ValueError):
    """The budget cannot hold what must fit at once; ``smallest_budget`` is the least that works."""

    def __init__(self, message: str, smallest_budget: int) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


class CallStoppedMidway(BudgetTooSmallError):
    """A call captured for speed stopped where a later graph of it was refused, after earlier graphs of
    it ran and changed what it was given (a cache passed in, a tensor written to): it cannot go on from
    there, and calls run eagerly from now on. A call that changed nothing it was given is run again as
    eager code instead (``entries``); a ``generate`` that made its own cache is run again from its start
    (``generate_memory``); any other call is the caller's to repeat."""


def format_bytes(size: int | float | None) -> str:
    """Human-readable binary size, e.g. ``'1.50 GiB'``; ``None`` reads ``'unlimited'``."""
    if size is None:
        return "unlimited"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


@dataclass(frozen=True)
class MemoryModel:
    """The budget of one model where it computes, and what is always held there.

    ``budget`` is None when there is no limit; ``budget_name`` is the keyword the user set it with
    (``cpu_memory`` or ``gpu_memory``), used in every message; ``fixed_bytes`` are the small parameters
    and buffers kept on the device; ``graph_bytes`` the host memory the graphs captured so far hold and
    ``capture_reserve`` the room kept for a capture under way or expected (``with_graph``).
    """

    budget: int | None
    budget_name: str = "gpu_memory"
    fixed_bytes: int = 0
    graph_bytes: int = 0
    capture_reserve: int = 0

    @classmethod
    def where_it_computes(
        cls, device_type: str, gpu_memory: int | None, cpu_memory: int | None, fixed_bytes: int = 0
    ) -> MemoryModel:
        """The budget of the compute device: ``gpu_memory`` on CUDA; on the CPU ``cpu_memory`` when set
        (else ``gpu_memory``, which then sizes the pieces as if a device had that much)."""
        if device_type == "cpu" and cpu_memory is not None:
            return cls(cpu_memory, "cpu_memory", fixed_bytes)
        return cls(gpu_memory, "gpu_memory", fixed_bytes)

    def with_graph(self, ops: int, saved: bool = False) -> MemoryModel:
        """This budget with one more captured graph of ``ops`` ops counted in it (its state lies in host
        memory: it counts where the budget is the host's; ``saved`` in the compile cache too), and room
        kept for as much again while dynamo finishes the capture (it builds the graph's guards after the
        backend returns, a transient about that large), until ``with_capture_reserve`` says otherwise."""
        state = graph_state_bytes(ops, saved)
        return replace(self, graph_bytes=self.graph_bytes + state, capture_reserve=graph_state_bytes(ops))

    def with_capture_reserve(self, reserve: int) -> MemoryModel:
        """This budget keeping ``reserve`` bytes for a capture to come (tracing a graph grows host memory
        about as much as its state before the backend sees it), or none."""
        return replace(self, capture_reserve=reserve)

    def need(self, *, activations: int = 0, resident: int = 0, in_flight: int = 0) -> int:
        """Bytes held at once with these activations, resident weights and pieces in flight."""
        # a capture happens between calls: its transient takes the room of activations, not of weights
        # (the staging arena stays allocated between calls)
        between = max(activations, self.capture_reserve)
        return self.fixed_bytes + self.graph_bytes + between + resident + in_flight

    def fits(self, *, activations: int = 0, resident: int = 0, in_flight: int = 0) -> bool:
        """Whether that much fits the budget (always, without one)."""
        need = self.need(activations=activations, resident=resident, in_flight=in_flight)
        return self.budget is None or need <= self.budget

    def room(self, activations: int) -> int | None:
        """Bytes left for weights (resident and in flight) beside these activations; None: no limit."""
        return None if self.budget is None else self.budget - self.need(activations=activations)

    def piece_target(self, policy: str, activations: int) -> int:
        """The weight bytes one piece aims for under ``policy`` (at least 1)."""
        room = self.room(activations)
        assert room is not None, "no piece target without a budget"
        return max(room // PIECE_DIVISOR[policy], 1)

    def smallest_budget(self, largest_piece: int, activations: int) -> int:
        """The least budget that streams pieces whose largest takes ``largest_piece`` bytes: it alone
        (a piece that does not fit beside its neighbour runs without overlap)."""
        return self.need(activations=activations, in_flight=aligned(largest_piece))

    def too_small(self, smallest: int, activations: int = 0, detail: str = "") -> BudgetTooSmallError:
        """The one "budget too small" error: what the budget must hold, and the budget that works."""
        what = f" ({detail})" if detail else ""
        # activations are sized by the call, not the model: where they are a large share, say so
        or_smaller = (
            ", or call it with a smaller batch or shorter inputs (the activations grow with both)"
            if activations * ACTIVATION_HINT_SHARE >= smallest
            else ""
        )
        graphs = f", {format_bytes(self.graph_bytes)} of captured graphs' state" if self.graph_bytes else ""
        if self.capture_reserve:
            graphs += f", {format_bytes(self.capture_reserve)} kept for capturing a graph"
        return BudgetTooSmallError(
            f"{self.budget_name}={format_bytes(self.budget)} is too small for this model{what}. "
            f"The largest piece alone, {format_bytes(activations)} of activations{graphs} and "
            f"{format_bytes(self.fixed_bytes)} of resident small tensors need at least "
            f"{format_bytes(smallest)}: pass {self.budget_name}={smallest} or more{or_smaller}",
            smallest_budget=smallest,
        )

    def check_weights(self, weight_bytes: Iterable[int], unit: str = "weight") -> None:
        """Refuse up front a budget that cannot stream the largest ``unit`` a weight streams in (a whole
        weight, or a tile of one; activations come later).

        Raises:
            BudgetTooSmallError: the largest unit does not fit beside the small tensors.
        """
        largest = max(weight_bytes, default=0)
        if self.budget is None or not largest:
            return
        smallest = self.smallest_budget(largest, 0)
        if smallest > self.budget:
            detail = f"the largest {unit} takes {format_bytes(largest)} and must fit whole"
            raise self.too_small(smallest, 0, detail)
