"""The memory model: one rule for what must fit, one error when it does not."""

from __future__ import annotations

import pytest

from fxoffload_hf.memory_model import (
    GRAPH_STATE_BYTES_PER_OP,
    SAVED_GRAPH_BYTES_PER_OP,
    BudgetTooSmallError,
    MemoryModel,
    aligned,
    cuts_for,
    nbytes,
    pair_bytes,
    piece_bytes,
    window_bytes,
)


def test_sizes_are_counted_at_aligned_offsets():
    assert nbytes((3, 5), 4) == 60
    assert nbytes((), 2) == 2
    assert aligned(1) == 64 and aligned(64) == 64 and aligned(65) == 128
    assert piece_bytes([1, 64, 65]) == 64 + 64 + 128


def test_windows_of_consecutive_pieces():
    assert window_bytes([5, 1, 1, 9, 2], 3) == 12
    assert pair_bytes([5, 1, 1, 9, 2]) == 11
    assert window_bytes([4], 3) == 4


def test_what_is_held_adds_up_and_fits_exactly_at_the_budget():
    memory = MemoryModel(1000, "cpu_memory", fixed_bytes=100)
    assert memory.need(activations=200, resident=300, in_flight=400) == 1000
    assert memory.fits(activations=200, resident=300, in_flight=400)
    assert not memory.fits(activations=200, resident=300, in_flight=401)
    assert memory.room(200) == 700
    assert MemoryModel(None).fits(resident=10**15) and MemoryModel(None).room(5) is None


def test_captured_graphs_state_is_held_beside_everything_else_and_named_when_too_much():
    capturing = MemoryModel(10**7, "cpu_memory", fixed_bytes=100).with_graph(100).with_graph(50)
    assert capturing.graph_bytes == 150 * GRAPH_STATE_BYTES_PER_OP
    memory = capturing.with_capture_reserve(0)
    assert memory.need(activations=7) == 100 + 150 * GRAPH_STATE_BYTES_PER_OP + 7
    assert memory.room(0) == 10**7 - 100 - memory.graph_bytes
    assert memory.smallest_budget(64, 0) == 100 + memory.graph_bytes + 64
    assert "captured graphs' state" in str(memory.too_small(memory.smallest_budget(64, 0)))
    assert "captured graphs" not in str(MemoryModel(10).too_small(100))


def test_a_capture_keeps_room_for_its_transient_in_place_of_activations_until_released():
    state = 50 * GRAPH_STATE_BYTES_PER_OP
    capturing = MemoryModel(10**7, "cpu_memory", fixed_bytes=100).with_graph(50)
    assert capturing.capture_reserve == state  # dynamo finishes the capture after the backend returns
    # between calls the transient takes the activations' room: the larger of the two is held
    assert capturing.need(activations=7, resident=3, in_flight=5) == 100 + state + state + 3 + 5
    assert capturing.need(activations=state + 9) == 100 + state + state + 9
    assert capturing.smallest_budget(64, 0) == 100 + 2 * state + 64
    assert "kept for capturing a graph" in str(capturing.too_small(capturing.smallest_budget(64, 0)))
    released = capturing.with_capture_reserve(0)
    assert released.need(activations=7) == 100 + state + 7 and released.graph_bytes == state


def test_a_graph_saved_in_the_compile_cache_holds_more_but_its_capture_no_more_transient():
    saving = MemoryModel(10**7, "cpu_memory").with_graph(50, saved=True)
    assert saving.graph_bytes == 50 * (GRAPH_STATE_BYTES_PER_OP + SAVED_GRAPH_BYTES_PER_OP)
    # the saved bytes are held, not a transient of dynamo finishing the capture
    assert saving.capture_reserve == MemoryModel(10**7, "cpu_memory").with_graph(50).capture_reserve


def test_piece_target_splits_the_room_by_policy():
    memory = MemoryModel(1000, fixed_bytes=100)
    assert memory.piece_target("auto", 100) == 800 // 8
    assert memory.piece_target("sequential", 100) == 800 // 2
    assert MemoryModel(10, fixed_bytes=100).piece_target("auto", 0) == 1


def test_smallest_budget_holds_the_largest_piece_alone():
    memory = MemoryModel(0, fixed_bytes=100)
    smallest = memory.smallest_budget(largest_piece=1000, activations=50)
    assert smallest == 100 + 50 + aligned(1000)
    assert MemoryModel(smallest, fixed_bytes=100).fits(activations=50, in_flight=aligned(1000))
    assert not MemoryModel(smallest - 1, fixed_bytes=100).fits(activations=50, in_flight=aligned(1000))


@pytest.mark.parametrize(
    ("pieces", "room", "cuts"),
    [
        ([10, 10, 10], 20, (False, False, False)),
        ([10, 30, 10], 35, (False, True, True)),
        ([30, 30], 59, (False, True)),
        ([5, 40, 5, 5], None, (False, False, False, False)),
    ],
)
def test_a_piece_that_does_not_fit_beside_its_neighbour_is_cut_from_it(pieces, room, cuts):
    assert cuts_for(pieces, room) == cuts
    # no window of pieces in flight spans a cut: what is held at once is the largest uncut run
    held = window_bytes(pieces, 2, cuts)
    assert held <= (room if room is not None else sum(pieces))
    assert held == max(
        [max(pieces)]
        + [a + b for a, b, cut in zip(pieces[:-1], pieces[1:], cuts[1:], strict=True) if not cut]
    )


def test_the_error_names_the_budget_and_the_size_that_works():
    error = MemoryModel(1000, "cpu_memory", fixed_bytes=10).too_small(5000, 300, "a detail")
    assert isinstance(error, BudgetTooSmallError) and isinstance(error, ValueError)
    assert error.smallest_budget == 5000
    message = str(error)
    assert "cpu_memory=1000 B is too small" in message and "(a detail)" in message
    assert "300 B of activations" in message and "pass cpu_memory=5000 or more" in message


def test_weights_are_checked_up_front_against_the_largest_alone():
    memory = MemoryModel(128 + 10, fixed_bytes=10)
    memory.check_weights([100, 128])  # exactly fits
    with pytest.raises(BudgetTooSmallError, match=r"largest weight takes 129 B.*pass gpu_memory=\d+") as info:
        memory.check_weights([129])
    assert info.value.smallest_budget == 10 + 192
    MemoryModel(None).check_weights([10**12])  # no budget: nothing to refuse


def test_the_budget_where_the_model_computes():
    assert MemoryModel.where_it_computes("cuda", 10, 20).budget == 10
    assert MemoryModel.where_it_computes("cpu", 10, 20) == MemoryModel(20, "cpu_memory", 0)
    assert MemoryModel.where_it_computes("cpu", 10, None, 5) == MemoryModel(10, "gpu_memory", 5)
