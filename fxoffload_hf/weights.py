"""``WeightStore``: every offloaded weight of one model by name, each in one tier.

Tiers: ``device`` (kept on the compute device), ``host`` (in host RAM, pinned when the device is CUDA),
``disk`` (a byte range of a safetensors file: the original checkpoint read in place, or a file written
once to ``offload_folder``). Tied weights are one record under their first name, with aliases.
"""

from __future__ import annotations

import enum
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from fxoffload_hf.memory import format_bytes
from fxoffload_hf.safetensors_io import TensorSlice, read_header, read_into


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass
class WeightRecord:
    """One weight: its identity, its tier, and where its bytes are."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    host: torch.Tensor | None = None
    disk: TensorSlice | None = None
    resident: torch.Tensor | None = None
    aliases: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @property
    def footprint(self) -> int:
        """Bytes in flight while this weight is brought in: the file's bytes, plus the converted copy if
        the file's dtype is not the compute dtype."""
        if self.disk is None or self.host is not None:
            return self.nbytes
        return self.disk.nbytes + (self.nbytes if self.disk.dtype != self.dtype else 0)

    @property
    def tier(self) -> Tier:
        if self.resident is not None:
            return Tier.DEVICE
        return Tier.HOST if self.host is not None else Tier.DISK


class WeightStore:
    """The weights of one model, by name, across tiers. Thread-safe for concurrent reads."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.records: dict[str, WeightRecord] = {}
        self._spilled_files: list[Path] = []
        self._temp_folder: Path | None = None
        # the model's own parameters that share a host tensor's memory: emptied when it is spilled
        self.sharers: dict[str, list[torch.Tensor]] = {}
        self._registered: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    # -- building -------------------------------------------------------------------------------
    def add_host(self, name: str, tensor: torch.Tensor) -> WeightRecord:
        """Hold ``tensor`` (already in host memory, or on the device) under ``name``."""
        record = WeightRecord(name, tuple(tensor.shape), tensor.dtype)
        if tensor.device == self.device:
            record.resident = tensor.detach()
        if tensor.device.type == "cpu":
            record.host = tensor.detach()
        elif record.resident is None:
            record.host = tensor.detach().cpu()
        self.records[name] = record
        return record

    def add_disk(self, name: str, source: TensorSlice, dtype: torch.dtype | None = None) -> WeightRecord:
        """Point ``name`` at a byte range of a safetensors file (read lazily, never copied)."""
        dtype = dtype or source.dtype
        record = WeightRecord(name, source.shape, dtype, disk=source)
        self.records[name] = record
        return record

    def add_alias(self, name: str, alias: str) -> None:
        self.records[name].aliases.append(alias)

    # -- tiers ----------------------------------------------------------------------------------
    def spill_folder(self, configured: Path | None) -> Path:
        """Where spilled weights go: the configured ``offload_folder``, else a temporary folder of ours."""
        if configured is not None:
            return configured
        if self._temp_folder is None:
            self._temp_folder = Path(tempfile.mkdtemp(prefix="fxoffload-"))
        return self._temp_folder

    def spill_to_disk(self, names: list[str], folder: Path) -> Path | None:
        """Write the host tensors of ``names`` once to ``folder`` (atomically) and drop them from RAM.

        Raises:
            OSError: the folder cannot be written (no space, no permission); nothing partial is left.
        """
        todo = {n: self.records[n] for n in names if self.records[n].host is not None}
        if not todo:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"fxoffload-{uuid.uuid4().hex[:12]}.safetensors"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-", suffix=".safetensors")
        os.close(fd)
        try:
            tensors = {n: r.host.contiguous() for n, r in todo.items() if r.host is not None}
            save_file(tensors, tmp)
            del tensors
            os.replace(tmp, final)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError | SafetensorError):
                raise OSError(
                    getattr(exc, "errno", None),
                    f"cannot write offloaded weights to {folder}: {getattr(exc, 'strerror', None) or exc}; "
                    "free space there or choose another offload_folder",
                ) from exc
            raise
        slices = read_header(final)
        for name, record in todo.items():
            record.disk = slices[name]
            record.host = None
            if self.device.type == "cpu":
                record.resident = None
            for sharer in self.sharers.pop(name, []):
                sharer.data = torch.empty(0, dtype=sharer.dtype)
        self._spilled_files.append(final)
        return final

    def set_dtype(self, name: str, dtype: torch.dtype) -> None:
        """Compute with ``dtype`` from now on (``model.to(dtype)`` on an offloaded model). Host copies convert
        now, as eager would; disk weights convert as they stream."""
        record = self.records[name]
        if record.dtype == dtype:
            return
        shared = record.resident is not None and record.resident is record.host
        if record.host is not None:
            record.host = record.host.to(dtype)
        if shared:
            record.resident = record.host
        elif record.resident is not None:
            record.resident = record.resident.to(dtype)
        record.dtype = dtype

    def pin_host_memory(self) -> None:
        """Page-lock host-tier tensors for fast, asynchronous copies, in place where CUDA allows
        (``cudaHostRegister``), so host RAM holds each weight once; else one tensor at a time."""
        cudart = torch.cuda.cudart()
        for record in self.records.values():
            host = record.host
            if host is None or host.is_pinned():
                continue
            storage = host.untyped_storage()
            code = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
            if int(code) == 0:
                self._registered.append(storage)
            else:
                record.host = host.pin_memory()

    def make_resident(self, name: str) -> None:
        """Keep ``name`` on the compute device from now on."""
        record = self.records[name]
        if record.resident is not None:
            return
        record.resident = self.read(record).to(self.device)

    def evict(self, name: str) -> None:
        """Stop keeping ``name`` on the device (it stays in its host or disk tier)."""
        record = self.records[name]
        if record.host is not None and record.host.device == self.device:
            return
        if record.host is None and record.disk is None:
            return
        record.resident = None

    def read(self, record: WeightRecord, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight's values on the host: its host tensor, or read from disk into ``out`` if given."""
        if record.host is not None:
            return record.host
        if record.resident is not None and record.disk is None:
            return record.resident
        source = record.disk
        assert source is not None
        buffer = out if out is not None else torch.empty(source.nbytes, dtype=torch.uint8)
        read_into([source], [buffer])
        return as_typed(buffer, source).to(record.dtype)

    # -- facts ----------------------------------------------------------------------------------
    def bytes_in(self, tier: Tier) -> int:
        return sum(r.nbytes for r in self.records.values() if r.tier == tier)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records.values())

    def summary(self) -> str:
        parts = [f"{t.value} {format_bytes(self.bytes_in(t))}" for t in Tier]
        return f"{len(self.records)} weights, " + ", ".join(parts)

    def close(self) -> None:
        """Drop every tensor and delete the files this store wrote (never the checkpoint's own)."""
        for record in self.records.values():
            record.resident = None
            record.host = None
        for storage in self._registered:
            torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())
        self._registered.clear()
        for path in self._spilled_files:
            path.unlink(missing_ok=True)
        self._spilled_files.clear()
        if self._temp_folder is not None:
            shutil.rmtree(self._temp_folder, ignore_errors=True)
            self._temp_folder = None


def as_typed(buffer: torch.Tensor, source: TensorSlice) -> torch.Tensor:
    """View raw bytes in ``buffer`` as the tensor ``source`` describes."""
    return buffer[: source.nbytes].view(source.dtype).view(source.shape)
