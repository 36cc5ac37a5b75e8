"""A weight record: its tier follows where its bytes are, and its footprint what bringing it in holds."""

from __future__ import annotations

from pathlib import Path

import torch

from fxoffload_hf.safetensors_io import TensorSlice
from fxoffload_hf.weight_record import Tier, WeightRecord


def _on_disk(file_dtype: torch.dtype, dtype: torch.dtype, **extra) -> WeightRecord:
    source = TensorSlice(Path("w.safetensors"), "w", 4096, 100 * file_dtype.itemsize, file_dtype, (10, 10))
    return WeightRecord("w", (10, 10), dtype, disk=source, **extra)


def test_the_tier_follows_where_the_bytes_are():
    record = _on_disk(torch.float32, torch.float32)
    assert record.tier is Tier.DISK and Tier.DISK.streams and Tier.DISK.from_file
    record.host = torch.zeros(10, 10)
    assert record.tier is Tier.HOST and Tier.HOST.streams and not Tier.HOST.from_file
    record.resident, record.mapped = torch.zeros(10, 10), True
    assert record.tier is Tier.MAPPED and not Tier.MAPPED.streams
    record.mapped = False
    assert record.tier is Tier.DEVICE and not Tier.DEVICE.streams


def test_the_footprint_counts_a_converted_copy_and_a_copied_tile_twice():
    assert _on_disk(torch.float32, torch.float32).footprint == 400
    assert _on_disk(torch.float16, torch.float32).footprint == 200 + 400  # the file's bytes and the copy
    assert _on_disk(torch.float32, torch.float32, tile_copied=True).footprint == 400 + 400
    assert WeightRecord("h", (10, 10), torch.float32, host=torch.zeros(10, 10)).footprint == 400
    assert not _on_disk(torch.float16, torch.float32).in_place  # a dtype change is never used in place
