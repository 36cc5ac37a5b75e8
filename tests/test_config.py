"""Budget strings, devices and policies: accepted with their documented meaning, or refused clearly."""

from __future__ import annotations

import pytest
import torch

from fxoffload_hf.config import OffloadConfig, parse_budget, resolve_device


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("1.5GiB", int(1.5 * 2**30)),
        ("800MB", 800 * 10**6),
        ("800 mb", 800 * 10**6),
        ("64KiB", 64 * 1024),
        ("4096", 4096),
        (4096, 4096),
        (4096.7, 4096),
        (None, None),
        (10**15, 10**15),
    ],
)
def test_budget_values_are_read_as_documented(spec, expected):
    assert parse_budget(spec) == expected


def test_percentage_is_a_share_of_free_memory():
    assert parse_budget("80%", free_bytes=1000) == 800
    assert parse_budget("100%", free_bytes=1000) == 1000


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0", "must be positive"),
        (0, "must be positive"),
        (-1, "must be positive"),
        ("-1", "cannot read"),
        ("abc", "cannot read"),
        ("12 parsecs", "unknown unit"),
        ("0%", "percentage"),
        ("150%", "percentage"),
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (True, "expected bytes"),
        ([1], "expected bytes"),
    ],
)
def test_bad_budgets_are_refused_with_a_clear_message(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(spec, free_bytes=1000, what="gpu_memory")


def test_device_none_means_cuda_when_available_else_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected


@pytest.mark.parametrize("device", ["tpu", "banana", "mps"])
def test_unsupported_devices_are_refused(device):
    with pytest.raises(ValueError, match="device"):
        resolve_device(device)


def test_config_is_frozen_and_validates_policy():
    config = OffloadConfig.build(gpu_memory="1GiB", device="cpu")
    with pytest.raises(AttributeError):
        config.gpu_memory = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="policy"):
        OffloadConfig.build(policy="greedy", device="cpu")
