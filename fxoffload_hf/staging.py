"""The staging arena: one host buffer that two consecutive loads share, from its two ends.

Even loads are laid out from its front, odd loads from its back, so two consecutive loads never overlap
as long as their sizes add up to its capacity (``memory_model.pair_bytes``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from fxoffload_hf.memory_model import aligned, piece_bytes


class StagingArena:
    """One host buffer (pinned for CUDA) for weights read from disk before they can be used."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffer = torch.empty(0, dtype=torch.uint8)

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def resize(self, capacity: int) -> None:
        """Hold exactly ``capacity`` bytes (only between calls: nothing may live in it then)."""
        if capacity != self.capacity:
            self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
            if capacity:
                self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=self.pin)

    def layout(self, sizes: list[int], side: int) -> list[torch.Tensor]:
        """Byte views for tensors of ``sizes`` from the front (side 0) or the back (side 1)."""
        total = piece_bytes(sizes)
        if total > self.capacity:
            raise RuntimeError(f"staging arena of {self.capacity} bytes cannot hold a piece of {total} bytes")
        start = 0 if side == 0 else self.capacity - total
        views, offset = [], start
        for size in sizes:
            views.append(self.buffer[offset : offset + size])
            offset += aligned(size)
        return views

    def detach(self, value: Any) -> Any:
        """Clone any tensor in ``value`` that views this arena, which the next loads overwrite."""
        if self.capacity == 0:
            return value
        arena = self.buffer.untyped_storage().data_ptr()
        return tree_map_only(
            torch.Tensor, lambda t: t.clone() if t.untyped_storage().data_ptr() == arena else t, value
        )

    def release(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
