"""The scheduler on synthetic profiles: unhidden copies first, budgets kept."""

from __future__ import annotations

from fxoffload_hf.memory_model import MemoryModel, pair_bytes, window_bytes
from fxoffload_hf.schedule import (
    PieceProfile,
    choose_distance,
    choose_resident,
    load_groups,
    simulated_seconds,
    unhidden_copy_seconds,
)


def profile(name: str, nbytes: int, copy: float, compute: float) -> PieceProfile:
    return PieceProfile((name,), {name: nbytes}, copy, compute)


def test_first_piece_copy_is_never_hidden_and_later_ones_by_the_compute_before():
    profiles = [profile("a", 10, 1.0, 2.0), profile("b", 10, 1.5, 0.5), profile("c", 10, 1.0, 1.0)]
    assert unhidden_copy_seconds(profiles) == [1.0, 0.0, 0.5]


def test_pieces_whose_copy_cannot_be_hidden_stay_resident_first():
    profiles = [
        profile("a", 100, 0.1, 5.0),  # copy fully exposed (first), but small
        profile("b", 100, 1.0, 5.0),  # hidden by a's compute
        profile("c", 100, 9.0, 5.0),  # 4 s exposed behind b's 5 s compute
        profile("d", 100, 1.0, 5.0),
    ]
    fixed = 10
    # room for c resident while the other three stream, then a too, but never a third piece
    budget = fixed + 100 + 2 * 128
    resident = choose_resident(profiles, MemoryModel(budget, fixed_bytes=fixed), activations=0)
    assert resident == {"a", "c"}


def test_resident_weights_are_chosen_by_what_they_hold_as_the_store_counts_it():
    profiles = [profile(name, 100, 9.0 if name == "c" else 1.0, 5.0) for name in "abcd"]
    memory = MemoryModel(10 + 4 * 110, fixed_bytes=10)
    assert choose_resident(profiles, memory, 0) == set("abcd")  # kept by their bytes: all of them
    # where each kept weight holds more (the 2 MiB units of mapping around it), some stream
    assert choose_resident(profiles, memory, 0, lambda names: 120 * len(list(names))) == {"a", "c"}
    assert choose_resident(profiles, memory, 0, lambda names: 300 * len(list(names))) == set()


def _aligned(size: int) -> int:
    return -(-size // 64) * 64


def test_resident_set_and_arena_always_fit_the_budget():
    profiles = [profile(f"p{i}", 50 + 10 * i, 0.2 * i, 0.1) for i in range(12)]
    largest_pair = max(
        _aligned(a.nbytes) + _aligned(b.nbytes) for a, b in zip(profiles, profiles[1:], strict=False)
    )
    grew = 0
    for budget in range(40 + largest_pair, 3000, 97):  # every budget at which streaming everything fits
        resident = choose_resident(profiles, MemoryModel(budget, fixed_bytes=40), activations=0)
        streamed = [0 if p.weights[0] in resident else _aligned(p.nbytes) for p in profiles]
        pairs = max(a + b for a, b in zip(streamed, streamed[1:], strict=False))
        used = 40 + sum(p.nbytes for p in profiles if p.weights[0] in resident) + pairs
        assert used <= budget, (budget, sorted(resident))
        grew += bool(resident)
    assert grew, "no budget kept anything resident: the check above was vacuous"


def test_shared_weights_count_once():
    shared = PieceProfile(("emb", "x"), {"emb": 100, "x": 10}, 1.0, 1.0)
    head = PieceProfile(("emb",), {"emb": 100}, 1.0, 1.0)
    resident = choose_resident([shared, head], MemoryModel(10 + 110 + 64 * 9, fixed_bytes=10), activations=0)
    assert resident == {"emb", "x"}


def test_arena_holds_any_two_consecutive_pieces():
    assert pair_bytes([100, 10, 100]) == 110
    assert pair_bytes([30, 10, 100, 5]) == 110
    assert pair_bytes([70]) == 70
    assert pair_bytes([]) == 0


def test_simulation_of_one_piece_ahead_matches_the_hand_count():
    # copy 1 | compute a 2 ; b's copy (3) runs under a's compute (2) and waits 1 more; c's copy under b's
    profiles = [profile("a", 10, 1.0, 2.0), profile("b", 10, 3.0, 1.0), profile("c", 10, 1.0, 1.0)]
    assert simulated_seconds(profiles, 1) == 1.0 + 3.0 + 1.0 + 1.0  # a loaded 1, b loaded 4, c ends 6
    # with everything loaded ahead the copy thread never waits for a slot: 1+3+1 copies, then computes
    assert simulated_seconds(profiles, 3) <= simulated_seconds(profiles, 1)


def test_deeper_prefetch_is_chosen_when_it_hides_more_and_fits():
    # long computes with small copies, then a big copy: one piece ahead leaves the big copy exposed
    profiles = [profile(f"p{i}", 100, 0.5, 3.0) for i in range(3)] + [profile("big", 100, 5.0, 1.0)]
    assert simulated_seconds(profiles, 2) < simulated_seconds(profiles, 1)
    room = window_bytes([128] * 4, 4)
    chosen = choose_distance(profiles, room)
    assert chosen >= 2
    assert simulated_seconds(profiles, chosen) == min(simulated_seconds(profiles, d) for d in (1, 2, 3))


def test_prefetch_stays_one_ahead_when_nothing_more_is_hidden_or_no_room():
    even = [profile(f"p{i}", 100, 0.5, 1.0) for i in range(6)]
    assert choose_distance(even, 10**9) == 1  # copies already hidden
    uneven = [profile(f"p{i}", 100, 0.5, 3.0) for i in range(3)] + [profile("big", 100, 5.0, 1.0)]
    assert choose_distance(uneven, window_bytes([128] * 4, 2)) == 1  # only two pieces fit at once


def test_window_bytes_is_the_largest_run_of_consecutive_pieces():
    assert window_bytes([5, 1, 1, 9, 2], 2) == 11
    assert window_bytes([5, 1, 1, 9, 2], 3) == 12
    assert window_bytes([5, 1], 4) == 6
    assert window_bytes([], 2) == 0


def test_load_groups_fill_the_room_in_order():
    sizes = [10, 0, 10, 5, 30, 0, 0, 12]
    ends = load_groups(sizes, room=20)
    # pieces streaming nothing (resident) join a group for free; a piece larger than the room runs alone
    assert ends == [3, 3, 3, 4, 5, 8, 8, 8]
    starts = [0, *sorted(set(ends))[:-1]]
    for start in starts:
        group = range(start, ends[start])
        assert all(ends[i] == ends[start] for i in group)
        assert sum(sizes[i] for i in group) <= 20 or len(group) == 1
    assert load_groups([], room=5) == []
    assert load_groups([0, 0, 0], room=0) == [3, 3, 3]


def _choose_resident_plainly(profiles: list[PieceProfile], memory: MemoryModel, activations: int) -> set[str]:
    """``choose_resident`` as first written: every piece's streamed bytes counted again per candidate."""
    from fxoffload_hf.memory_model import piece_bytes

    unhidden = unhidden_copy_seconds(profiles)
    order = sorted(range(len(profiles)), key=lambda i: (-(unhidden[i] / max(profiles[i].nbytes, 1)), i))
    resident: set[str] = set()
    for index in order:
        candidate = resident | set(profiles[index].weights)
        if candidate == resident:
            continue
        streamed = [piece_bytes(p.weight_bytes[w] for w in p.weights if w not in candidate) for p in profiles]
        kept = sum({w: b for p in profiles for w, b in p.weight_bytes.items()}[w] for w in candidate)
        if memory.fits(activations=activations, resident=kept, in_flight=pair_bytes(streamed)):
            resident = candidate
    return resident


def test_choosing_from_the_pieces_a_candidate_changes_keeps_what_counting_them_all_kept():
    """Shared weights (an embedding in two pieces), pieces of several weights and alike sizes (ties in
    the pair that holds the most): the same residents as recounting every piece per candidate."""
    import random

    rng = random.Random(0)
    for trial in range(60):
        names = [f"w{i}" for i in range(rng.randint(1, 14))]
        sizes = {w: rng.choice([64, 128, 192, rng.randint(1, 400)]) for w in names}
        profiles = []
        for _ in range(rng.randint(1, 12)):
            weights = tuple(dict.fromkeys(rng.sample(names, rng.randint(1, min(3, len(names))))))
            profiles.append(PieceProfile(weights, {w: sizes[w] for w in weights}, rng.random(), rng.random()))
        for budget in range(100, 3000, 173):
            memory = MemoryModel(budget, fixed_bytes=20)
            expected = _choose_resident_plainly(profiles, memory, 30)
            assert choose_resident(profiles, memory, 30) == expected, (trial, budget)
