"""From measured copy and compute times, within a byte budget: which pieces' weights stay resident, how
many pieces ahead the rest are loaded, and which consecutive pieces load together. Pure: numbers in,
numbers out; what fits is asked of ``memory_model``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fxoffload_hf.memory_model import MemoryModel, pair_bytes, piece_bytes, window_bytes


@dataclass(frozen=True)
class PieceProfile:
    """What one piece costs: the bytes it streams, the seconds its copy and its compute took."""

    weights: tuple[str, ...]
    weight_bytes: dict[str, int]
    copy_seconds: float
    compute_seconds: float

    @property
    def nbytes(self) -> int:
        return sum(self.weight_bytes[w] for w in self.weights)


def unhidden_copy_seconds(profiles: list[PieceProfile]) -> list[float]:
    """Copy time of each piece that the compute of the piece before it cannot hide.

    Piece 0's copy has nothing before it in the call, so none of it is hidden.
    """
    result = []
    for index, profile in enumerate(profiles):
        cover = profiles[index - 1].compute_seconds if index > 0 else 0.0
        result.append(max(profile.copy_seconds - cover, 0.0))
    return result


def choose_resident(
    profiles: list[PieceProfile],
    memory: MemoryModel,
    activations: int,
    held: Callable[[Iterable[str]], int] | None = None,
) -> set[str]:
    """Pick the weights to keep on the device: pieces whose copy cannot be hidden come first.

    What stays resident, the remaining streamed pieces (two in flight) and ``activations`` must fit
    ``memory``. Pieces are taken whole, most unhidden copy time per byte first, then the rest in
    execution order while they fit. ``held`` says what a set of weights kept holds (by default their
    bytes; the store counts the 2 MiB units of mapping that weights kept in place hold whole); pieces in
    flight count their bytes, as the partition that cut them did.
    """
    sizes = {w: b for p in profiles for w, b in p.weight_bytes.items()}
    kept = held or (lambda names: sum(sizes[w] for w in names))
    unhidden = unhidden_copy_seconds(profiles)
    order = sorted(
        range(len(profiles)),
        key=lambda i: (-(unhidden[i] / max(profiles[i].nbytes, 1)), i),
    )
    resident: set[str] = set()
    # what each piece streams with nothing kept, and the pieces each weight is in: a candidate changes
    # only the pieces holding its weights (thousands of pieces: tiles), so in flight is found from those
    streamed = [piece_bytes(p.weight_bytes.values()) for p in profiles]
    pieces_of: dict[str, list[int]] = {}
    for i, profile in enumerate(profiles):
        for weight in profile.weights:
            pieces_of.setdefault(weight, []).append(i)
    in_flight = pair_bytes(streamed)
    for index in order:
        candidate = resident | set(profiles[index].weights)
        if candidate == resident:
            continue
        touched = {i for w in candidate - resident for i in pieces_of[w]}
        trial = {
            i: piece_bytes(profiles[i].weight_bytes[w] for w in profiles[i].weights if w not in candidate)
            for i in touched
        }
        flight = _pair_bytes_after(streamed, trial, in_flight)
        if memory.fits(activations=activations, resident=kept(candidate), in_flight=flight):
            resident, in_flight = candidate, flight
            for i, nbytes in trial.items():
                streamed[i] = nbytes
    return resident


def _pair_bytes_after(streamed: list[int], changed: dict[int, int], before: int) -> int:
    """``pair_bytes`` of ``streamed`` with the pieces in ``changed`` streaming less, given ``before``, its
    value now: where no changed piece is in a pair that holds ``before``, an unchanged pair still does."""
    if len(streamed) > 1 and all(
        streamed[j] + streamed[j + 1] < before
        for i in changed
        for j in (i - 1, i)
        if 0 <= j < len(streamed) - 1
    ):
        return before
    trial = list(streamed)
    for i, nbytes in changed.items():
        trial[i] = nbytes
    return pair_bytes(trial)


def simulated_seconds(profiles: list[PieceProfile], distance: int) -> float:
    """Seconds one call takes when loads run ``distance`` pieces ahead of compute on one copy thread.

    A piece's load starts once the one before it is loaded and, with at most ``distance + 1`` pieces
    held, once the piece ``distance + 1`` places before it has computed; its compute starts once it is
    loaded and the piece before it has computed.
    """
    loaded: list[float] = []
    computed: list[float] = []
    for index, profile in enumerate(profiles):
        start = loaded[-1] if loaded else 0.0
        if index > distance:
            start = max(start, computed[index - distance - 1])
        loaded.append(start + profile.copy_seconds)
        computed.append(max(loaded[-1], computed[-1] if computed else 0.0) + profile.compute_seconds)
    return computed[-1] if computed else 0.0


def choose_distance(profiles: list[PieceProfile], room: int, max_distance: int = 4) -> int:
    """How many pieces ahead to load: the smallest distance with the shortest simulated call whose pieces in
    flight (``distance + 1`` consecutive streamed pieces) fit in ``room`` bytes; at least 1."""
    sizes = [piece_bytes(p.weight_bytes.values()) for p in profiles]
    best, best_seconds = 1, simulated_seconds(profiles, 1)
    for distance in range(2, max_distance + 1):
        if window_bytes(sizes, distance + 1) > room:
            break
        seconds = simulated_seconds(profiles, distance)
        if seconds < best_seconds * 0.99:
            best, best_seconds = distance, seconds
    return best


def load_groups(sizes: list[int], room: int) -> list[int]:
    """Runs of consecutive pieces loaded as one (``sizes``: what each streams), each within ``room``
    bytes; for each piece, the index one past the end of its run. A piece larger than ``room`` runs alone,
    and pieces that stream nothing join their neighbours for free."""
    ends = [0] * len(sizes)
    start = 0
    while start < len(sizes):
        end, total = start + 1, sizes[start]
        while end < len(sizes) and total + sizes[end] <= room:
            total += sizes[end]
            end += 1
        ends[start:end] = [end] * (end - start)
        start = end
    return ends
