"""Which pieces' weights stay resident, from measured copy and compute times, within a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

from fxoffload_hf.transfer import arena_bytes, piece_arena_bytes


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


def choose_resident(profiles: list[PieceProfile], budget: int, fixed_bytes: int) -> set[str]:
    """Pick the weights to keep on the device: pieces whose copy cannot be hidden come first.

    ``budget`` covers the resident weights, the staging arena the remaining streamed pieces need, and
    ``fixed_bytes`` (activations and small resident tensors). Pieces are taken whole, most unhidden copy
    time per byte first, then the rest in execution order while they fit.
    """
    unhidden = unhidden_copy_seconds(profiles)
    order = sorted(
        range(len(profiles)),
        key=lambda i: (-(unhidden[i] / max(profiles[i].nbytes, 1)), i),
    )
    resident: set[str] = set()
    sizes = {w: b for p in profiles for w, b in p.weight_bytes.items()}
    for index in order:
        candidate = resident | set(profiles[index].weights)
        if candidate == resident:
            continue
        resident_bytes = sum(sizes[w] for w in candidate)
        streamed = [
            piece_arena_bytes([p.weight_bytes[w] for w in p.weights if w not in candidate]) for p in profiles
        ]
        if fixed_bytes + resident_bytes + arena_bytes(streamed) <= budget:
            resident = candidate
    return resident
