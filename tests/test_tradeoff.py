"""Predicted decode speed at a budget: where the weights lie, and the slower of copy and compute."""

from __future__ import annotations

import pytest

from fxoffload_hf.tradeoff import Bandwidths, budgets_between, estimate

BW = Bandwidths(disk=1e9, link=10e9, cpu_memory=20e9, gpu_memory=1000e9)
GIB = 2**30


def _at(budget: int, device_type: str = "cuda", host_budget: int | None = None):
    return estimate(
        budget,
        weights=10 * GIB,
        fixed=GIB // 8,
        activations=GIB // 8,
        in_flight=GIB,
        device_type=device_type,
        host_budget=host_budget,
        bandwidths=BW,
    )


def test_on_a_gpu_what_the_budget_cannot_keep_streams_from_host_then_disk():
    low = _at(2 * GIB, host_budget=4 * GIB)
    assert low.resident == 2 * GIB - GIB // 4 - GIB
    assert low.from_host == 4 * GIB and low.from_disk == 10 * GIB - low.resident - 4 * GIB
    assert low.seconds_per_token == pytest.approx(4 * GIB / 10e9 + low.from_disk / 1e9)


def test_everything_resident_is_bound_by_the_compute_device_reading_the_weights():
    full = _at(11 * GIB)
    assert full.resident == 10 * GIB and full.from_host == full.from_disk == 0
    assert full.seconds_per_token == pytest.approx(10 * GIB / 1000e9)


def test_on_the_cpu_what_the_budget_cannot_keep_is_read_from_disk():
    half = _at(5 * GIB, device_type="cpu")
    assert half.from_host == 0 and half.from_disk == 10 * GIB - half.resident
    assert half.seconds_per_token == pytest.approx(max(half.from_disk / 1e9, 10 * GIB / 20e9))


def test_more_budget_is_never_slower():
    speeds = [_at(b).tokens_per_second for b in budgets_between(GIB, 11 * GIB)]
    assert speeds == sorted(speeds)


def test_budgets_run_from_the_floor_to_all_resident():
    assert budgets_between(100, 500) == [100, 200, 300, 400, 500]
    assert budgets_between(500, 100) == [500]
