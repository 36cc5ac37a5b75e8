"""``WeightStore``: every offloaded weight of one model by name, and the one owner of where each lies.

Each weight (a ``weight_record.WeightRecord``) is in one ``Tier`` at a time, and only the store moves
it (``keep``, ``evict``, ``spill``). Tied weights are one record under their first name, with aliases.
Every move bumps ``version``, so a plan made for one placement is never run against another.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import torch

from fxoffload_hf import temp_folders
from fxoffload_hf.mapped_io import MappedFiles, MappedGroup
from fxoffload_hf.memory_model import format_bytes
from fxoffload_hf.safetensors_io import TensorSlice, read_header, read_into
from fxoffload_hf.spill_files import remove_written, write_weights_file
from fxoffload_hf.weight_record import Tier, WeightRecord


class WeightStore:
    """The weights of one model, by name, across tiers. Thread-safe for concurrent reads."""

    def __init__(self, device: torch.device, *, drop_cache: bool = False) -> None:
        self.device = device
        # under a memory limit the page cache is charged to us: unmapped pages are dropped from it too
        self.drop_cache = drop_cache
        self.files = MappedFiles()  # the checkpoint files' private mappings, shared with the loaders
        self.version = 0  # bumped by every change of tier or dtype
        self.records: dict[str, WeightRecord] = {}
        self._tiles: dict[str, list[str]] = {}  # per weight, the names of its tiles (``add_tile``)
        # files spilled, then our own folder for them: removed at ``close``, else when the store is
        # collected or the interpreter exits (a process that never restores its model leaves none)
        self._written: list[Path] = []
        self._remove_written = weakref.finalize(self, remove_written, self._written, os.getpid())
        self._temp_folder: Path | None = None
        # the model's own parameters that share a host tensor's memory: emptied when it is spilled
        self.sharers: dict[str, list[torch.Tensor]] = {}
        self._registered: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()
        self._in_place: tuple[int, frozenset[TensorSlice]] = (-1, frozenset())

    # -- building -------------------------------------------------------------------------------
    def add_host(self, name: str, tensor: torch.Tensor, *, requires_grad: bool = False) -> WeightRecord:
        """Hold ``tensor`` (already in host memory, or on the device) under ``name``; ``requires_grad``
        is the flag of the parameter it stands for."""
        value = tensor.detach()
        record = WeightRecord(name, tuple(value.shape), value.dtype, requires_grad=requires_grad)
        if value.device == self.device:
            record.resident = value
        if value.device.type == "cpu":
            record.host = value  # on a CPU run, the same tensor as ``resident``: held once
        elif record.resident is None:
            record.host = value.cpu()
        self.records[name] = record
        return record

    def add_disk(
        self, name: str, source: TensorSlice, dtype: torch.dtype | None = None, *, requires_grad: bool = False
    ) -> WeightRecord:
        """Point ``name`` at a byte range of a safetensors file (read lazily, never copied);
        ``requires_grad`` is the flag of the parameter it stands for."""
        dtype = dtype or source.dtype
        record = WeightRecord(name, source.shape, dtype, disk=source, requires_grad=requires_grad)
        self.records[name] = record
        return record

    def add_tile(
        self, name: str, start: int, stop: int, *, copied: bool, compute_dtype: torch.dtype | None = None
    ) -> WeightRecord:
        """Rows ``start:stop`` of weight ``name`` as a weight of their own, streamed like any other: a
        byte range of the same file, or a view of the same host tensor (``tiles``); ``copied``: copied
        into a whole-shaped buffer to compute; ``compute_dtype``: converted to it first. Made once (the
        widest conversion any graph asks for stays counted)."""
        tile_name = f"{name}[{start}:{stop}]"
        made = self.records.get(tile_name)
        if made is not None and compute_dtype is not None:
            counted = made.tile_compute_dtype
            if counted is None or compute_dtype.itemsize > counted.itemsize:
                made.tile_compute_dtype = compute_dtype
        if made is None:
            parent = self.records[name]
            shape = (stop - start, *parent.shape[1:])
            self.records[tile_name] = WeightRecord(
                tile_name,
                shape,
                parent.dtype,
                requires_grad=parent.requires_grad,
                tile_of=name,
                tile_rows=(start, stop),
                tile_copied=copied,
                tile_compute_dtype=compute_dtype,
            )
            self._tiles.setdefault(name, []).append(tile_name)
            self._point_tile(self.records[tile_name], parent)
        return self.records[tile_name]

    def _refresh_tiles(self, name: str) -> None:
        """Point the tiles of ``name`` at its bytes as they are now (after a spill or a dtype change)."""
        parent = self.records[name]
        for tile_name in self._tiles.get(name, ()):
            self._point_tile(self.records[tile_name], parent)

    def _point_tile(self, tile: WeightRecord, parent: WeightRecord) -> None:
        self.evict(tile.name)
        start, stop = tile.tile_rows
        tile.dtype = parent.dtype
        tile.host = None if parent.host is None else parent.host[start:stop]
        tile.disk = None
        if parent.disk is not None:
            row = parent.disk.nbytes // parent.shape[0]
            tile.disk = replace(
                parent.disk,
                offset=parent.disk.offset + start * row,
                nbytes=(stop - start) * row,
                shape=tile.shape,
            )

    def weights(self) -> list[WeightRecord]:
        """The model's weights, without the tiles made of them."""
        return [r for r in self.records.values() if r.tile_of is None]

    def add_alias(self, name: str, alias: str) -> None:
        self.records[name].aliases.append(alias)

    # -- tiers ----------------------------------------------------------------------------------
    def spill_folder(self, configured: Path | None) -> Path:
        """Where spilled weights go: the configured ``offload_folder``, else a temporary folder of ours."""
        if configured is not None:
            return configured
        if self._temp_folder is None:
            self._temp_folder = temp_folders.make()
            self._written.append(self._temp_folder)  # after its files: they go first
        return self._temp_folder

    def ram_bytes(self) -> int:
        """Bytes of the weights held in host RAM."""
        return sum(r.nbytes for r in self.weights() if r.host is not None)

    def spill_ram(self, configured_folder: Path | None) -> Path | None:
        """Spill every weight held in host RAM to ``configured_folder`` (else a folder of ours)."""
        names = [r.name for r in self.weights() if r.host is not None]
        return self.spill(names, self.spill_folder(configured_folder)) if names else None

    def spill(self, names: list[str], folder: Path) -> Path | None:
        """Write the host tensors of ``names`` once to ``folder`` (atomically) and drop them from RAM.

        Raises:
            OSError: the folder cannot be written (no space, no permission); nothing partial is left.
        """
        todo = {n: self.records[n] for n in names if self.records[n].host is not None}
        if not todo:
            return None
        tensors = {n: r.host.contiguous() for n, r in todo.items() if r.host is not None}
        final = write_weights_file(tensors, folder)
        del tensors
        slices = read_header(final)
        self.version += 1
        for name, record in todo.items():
            record.disk = slices[name]
            if record.host is not None:
                self._unpin(record.host)
            record.host = None
            if self.device.type == "cpu":
                record.resident = None
            for sharer in self.sharers.pop(name, []):
                sharer.data = torch.empty(0, dtype=sharer.dtype)
            self._refresh_tiles(name)
        self._written.insert(0, final)
        return final

    def set_dtype(self, name: str, dtype: torch.dtype) -> None:
        """Compute with ``dtype`` from now on (``model.to(dtype)`` on an offloaded model). Host copies convert
        now, as eager would; disk weights convert as they stream."""
        record = self.records[name]
        if record.dtype == dtype:
            return
        self.version += 1
        shared = record.resident is not None and record.resident is record.host
        if record.host is not None:
            record.host = record.host.to(dtype)
        if shared:
            record.resident = record.host
        elif record.resident is not None:
            record.resident = record.resident.to(dtype)
        record.dtype = dtype
        self._refresh_tiles(name)

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

    def drop_host(self, name: str) -> None:
        """Let go of the host copy of ``name``, a weight that also lies in a file (nothing is written: it
        streams from there from now on)."""
        record = self.records[name]
        if record.host is None:
            return
        assert record.disk is not None, f"{name} has no copy but its host tensor: spill it instead"
        self._unpin(record.host)
        self.version += 1
        record.host = None
        self._refresh_tiles(name)

    def _unpin(self, host: torch.Tensor) -> None:
        """Unregister ``host``'s memory from CUDA where ``pin_host_memory`` pinned it in place: before it
        is freed."""
        address = host.untyped_storage().data_ptr()
        for registered in [s for s in self._registered if s.data_ptr() == address]:
            torch.cuda.cudart().cudaHostUnregister(address)
            self._registered.remove(registered)

    def movable(self, record: WeightRecord) -> bool:
        """Whether ``keep`` and ``evict`` apply: not a weight whose only copy is in RAM on a CPU run."""
        return record.host is None or self.device.type != "cpu"

    def read_ahead(self, group: MappedGroup) -> None:
        """Ask for ``group``'s pages in the background, where the page cache keeps pages after use; not
        where they are dropped after each use (``drop_cache``): the kernel reads ahead in 4 KiB pages, not
        the 2 MiB folios of a fault, and dropping a neighbour's pages then waits on them (eager decode
        steps under a memory limit took 1.4x as long with it)."""
        if not self.drop_cache:
            self.files.read_ahead(group)

    def keep(self, name: str) -> None:
        """Keep ``name`` where the model computes from now on: on the CPU, a weight that can be used in
        place as its file's pages kept mapped; else a device copy."""
        record = self.records[name]
        if record.resident is not None:
            return
        self.version += 1
        if self.keeps_in_place(record):
            assert record.disk is not None
            view = self.files.view(record.disk)
            self.files.populate([view])
            record.resident, record.mapped = view, True
        else:
            record.resident = self.read(record).to(self.device)

    def keeps_in_place(self, record: WeightRecord) -> bool:
        """Whether ``keep`` keeps ``record`` as its file's pages mapped (else as a copy)."""
        return self.device.type == "cpu" and record.host is None and record.in_place

    def held_bytes(self, records: Iterable[WeightRecord]) -> int:
        """What ``records`` hold at once where the model computes (``HeldBytes``)."""
        return HeldBytes(self, records).total

    def in_place_key(self) -> frozenset[TensorSlice]:
        """``in_place_sources`` as one set per version of the store (``HeldBytes`` asks often)."""
        if self._in_place[0] != self.version:
            self._in_place = (self.version, frozenset(self.in_place_sources()))
        return self._in_place[1]

    def in_place_sources(self) -> list[TensorSlice]:
        """The file bytes of every weight ``keep`` would keep as mapped pages (``keeps_in_place``)."""
        seen = {id(r): r for r in self.records.values() if r.disk is not None and self.keeps_in_place(r)}
        return [r.disk for r in seen.values() if r.disk is not None]

    def evict(self, name: str) -> None:
        """Stop keeping ``name`` where the model computes (it streams from its host or disk tier)."""
        record = self.records[name]
        if (
            record.resident is None
            or not self.movable(record)
            or (record.host is None and record.disk is None)
        ):
            return
        self.version += 1
        if record.mapped:
            self.files.release([record.resident], self.drop_cache)
        record.resident, record.mapped = None, False

    def set_residents(self, wanted: set[str]) -> None:
        """Keep exactly the movable weights in ``wanted`` where the model computes; the rest stream."""
        for name, record in self.records.items():
            if self.movable(record) and name not in wanted:
                self.evict(name)
        for name in wanted:
            if self.movable(self.records[name]):
                self.keep(name)

    def kept_sources(self, records: list[WeightRecord]) -> list[TensorSlice]:
        """The file ranges of those of ``records`` kept as mapped pages (checked before each use)."""
        return [r.disk for r in records if r.mapped and r.disk is not None]

    def read(self, record: WeightRecord, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight's values on the host: its host tensor, or read from disk into ``out`` if given."""
        if record.host is not None:
            return record.host
        if record.resident is not None and record.disk is None:
            return record.resident
        assert record.disk is not None
        return self.read_source(record.disk, record.dtype, out)

    @staticmethod
    def read_source(source: TensorSlice, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor's values read from its file (into ``out`` if given), as ``dtype``."""
        buffer = out if out is not None else torch.empty(source.nbytes, dtype=torch.uint8)
        read_into([source], [buffer])
        return as_typed(buffer, source).to(dtype)

    # -- facts ----------------------------------------------------------------------------------
    def bytes_in(self, tier: Tier) -> int:
        return sum(r.nbytes for r in self.weights() if r.tier == tier)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.weights())

    def __str__(self) -> str:
        return self.summary()

    def summary(self) -> str:
        parts = [f"{t.value} {format_bytes(self.bytes_in(t))}" for t in Tier]
        return f"{len(self.weights())} weights, " + ", ".join(parts)

    def close(self) -> None:
        """Drop every tensor and delete the files this store wrote (never the checkpoint's own)."""
        for record in self.records.values():
            record.resident, record.mapped = None, False
            record.host = None
        self.files.close()
        for storage in self._registered:
            torch.cuda.cudart().cudaHostUnregister(storage.data_ptr())
        self._registered.clear()
        self._remove_written()
        self._temp_folder = None


class HeldBytes:
    """What a set of weights kept where the model computes holds: a copy's footprint each, and for
    weights used in place as their file's pages (``WeightStore.keeps_in_place``) the 2 MiB units those
    pages lie in, each unit once (``MappedFiles.held_bytes``): mapped whole, a unit holds more than the
    weight where it shares the unit with another. ``cost`` and ``add`` grow the set one weight at a time."""

    def __init__(self, store: WeightStore, records: Iterable[WeightRecord] = ()) -> None:
        self.store = store
        self.units: set[tuple[int, int]] = set()
        self.copies = 0
        for record in records:
            self.add(record)

    @property
    def total(self) -> int:
        mapped = self.store.files.held_bytes(self.units, self.store.in_place_key()) if self.units else 0
        return self.copies + mapped

    def cost(self, record: WeightRecord) -> int:
        """The bytes adding ``record`` would add."""
        if record.disk is None or not self.store.keeps_in_place(record):
            return record.footprint
        new = set(self.store.files.units(record.disk)) - self.units
        return self.store.files.held_bytes(new, self.store.in_place_key())

    def add(self, record: WeightRecord) -> None:
        if record.disk is not None and self.store.keeps_in_place(record):
            self.units.update(self.store.files.units(record.disk))
        else:
            self.copies += record.footprint


def as_typed(buffer: torch.Tensor, source: TensorSlice) -> torch.Tensor:
    """View raw bytes in ``buffer`` as the tensor ``source`` describes."""
    return buffer[: source.nbytes].view(source.dtype).view(source.shape)
