"""``WeightRecord``: one offloaded weight, where its bytes are, and the ``Tier`` that placement makes.

A weight is in one tier at a time (only ``weights.WeightStore`` moves it):

- ``device``: kept where the model computes (a device copy on CUDA; on the CPU, its tensor in RAM);
- ``host``: in host RAM (pinned), copied to the CUDA device for each piece;
- ``mapped``: on the CPU, its checkpoint file's pages kept mapped between calls (no private copy);
- ``disk``: a byte range of a safetensors file (the checkpoint read in place, or a file written once to
  ``offload_folder``), read for each piece.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from fxoffload_hf.mapped_io import can_map
from fxoffload_hf.memory_model import nbytes
from fxoffload_hf.safetensors_io import TensorSlice


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    MAPPED = "mapped"
    DISK = "disk"

    @property
    def streams(self) -> bool:
        """Whether a weight in this tier is brought to the device for each piece that uses it."""
        return self in (Tier.HOST, Tier.DISK)

    @property
    def from_file(self) -> bool:
        """Whether bringing it in reads its file."""
        return self is Tier.DISK


@dataclass
class WeightRecord:
    """One weight: its identity and where its bytes are. Only ``WeightStore`` changes the placement."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    host: torch.Tensor | None = None
    disk: TensorSlice | None = None
    resident: torch.Tensor | None = None
    aliases: list[str] = field(default_factory=list)
    mapped: bool = False  # ``resident`` is a view of its file's pages
    tile_of: str | None = None  # rows ``tile_rows`` of this weight, computed with as a tile (``tiles``)
    tile_rows: tuple[int, int] = (0, 0)
    tile_copied: bool = False  # the tile is copied into a whole-shaped buffer to compute (on the CPU)
    # the dtype the model converts the weight to before its projection (``W.float()``), where it does
    tile_compute_dtype: torch.dtype | None = None
    # the parameter's own flag: ATen picks some kernels by it even without autograd (see
    # ``loaders.as_parameters``), so the compute must see the weight with it
    requires_grad: bool = False

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype.itemsize)

    @property
    def footprint(self) -> int:
        """Bytes in flight while this weight is brought in: the file's bytes, plus the converted copy if
        the file's dtype is not the compute dtype."""
        # a tile copied into its weight's whole-shaped buffer for the compute is held twice; a tile the
        # model converts is held converted too, and its copy in the buffer is in the converted dtype
        compute = self.tile_compute_dtype
        converted = 0
        if compute is not None and compute != self.dtype:
            converted = nbytes(self.shape, compute.itemsize)
        copy = converted + ((converted or self.nbytes) if self.tile_copied else 0)
        if self.disk is None or self.host is not None:
            return self.nbytes + copy
        return self.disk.nbytes + (self.nbytes if self.disk.dtype != self.dtype else 0) + copy

    @property
    def tier(self) -> Tier:
        if self.resident is not None:
            return Tier.MAPPED if self.mapped else Tier.DEVICE
        return Tier.HOST if self.host is not None else Tier.DISK

    @property
    def in_place(self) -> bool:
        """Whether ops can compute with its file's bytes as they lie (CPU streaming): same dtype, aligned
        as eager's copy would be (``mapped_io.can_map``)."""
        return self.disk is not None and can_map(self.disk, self.dtype)

    @property
    def mappable(self) -> bool:
        """Whether its file's bytes can be mapped to be copied from (rows looked up, a tile's rows)."""
        return self.disk is not None and can_map(self.disk, self.dtype, compute=False)
