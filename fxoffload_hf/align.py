"""A copy of a checkpoint whose tensors lie at aligned offsets, so that a CPU run uses them in place.

The safetensors format aligns the data section to 8 bytes only. Where it starts 8 bytes off a multiple
of 16, ATen's kernels would round differently on views of the mapped file, so fxoffload copies each such
weight at each use (``mapped_io.can_map``). Rewriting a shard's header with trailing spaces (as the format
itself pads it) moves the data section to a multiple of 64 bytes; the data bytes are copied unchanged, so
every tensor whose size is a multiple of 16 bytes (all of a usual checkpoint's) lands aligned.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from tqdm.auto import tqdm

from fxoffload_hf.memory_model import format_bytes
from fxoffload_hf.progress import warn
from fxoffload_hf.safetensors_io import read_header
from fxoffload_hf.weights import WeightStore

DATA_ALIGN = 64  # as the allocator aligns a tensor of its own
_COPY_CHUNK = 16 * 2**20


def warn_of_unaligned_weights(store: WeightStore) -> None:
    """Say when weights a CPU run could use in place from their files are copied at each use instead,
    because their offsets are not aligned for ATen's kernels, and how to fix it."""
    copied = [r for r in store.weights() if r.mappable and not r.in_place]
    if copied:
        warn(
            "%d of %d weights (%s) lie in their safetensors files at offsets not aligned to 16 bytes: "
            "they are copied at each use instead of used in place, which streams slower (0.65x measured "
            "in benchmarks/bench_alignment.py); `fxoffload-hf align CHECKPOINT NEW_FOLDER` writes a copy "
            "whose weights are all used in place",
            len(copied),
            len(store.weights()),
            format_bytes(sum(r.nbytes for r in copied)),
        )


def align_checkpoint(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> Path:
    """Copy the checkpoint folder ``source`` to ``destination`` (which must not exist yet) with every
    safetensors shard's data section aligned to 64 bytes; other files (config, index, tokenizer) are
    copied as they are. Returns ``destination``.

    Raises:
        FileNotFoundError: ``source`` is not a folder holding safetensors files.
        FileExistsError: ``destination`` exists.
        CheckpointError: a shard is not a readable safetensors file (nothing is left at ``destination``).
    """
    src, dst = Path(source), Path(destination)
    shards = sorted(src.glob("*.safetensors")) if src.is_dir() else []
    if not shards:
        raise FileNotFoundError(f"{src}: no safetensors files there; pass a checkpoint folder")
    if dst.exists():
        raise FileExistsError(f"{dst} exists; pass a new folder for the aligned copy")
    partial = dst.with_name(f".{dst.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        for path in src.iterdir():
            if path.is_file() and path.suffix != ".safetensors":
                shutil.copy2(path, partial / path.name)
        for shard in tqdm(shards, desc="Aligning shards", unit="shard"):
            _write_aligned(shard, partial / shard.name)
        partial.rename(dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return dst


def align_shards_in_place(folder: Path, data_start: int = 0) -> None:
    """Rewrite the safetensors shards of a folder this library wrote itself (demo, benchmark and test
    checkpoints) with their data sections at ``data_start`` modulo 64 bytes (0: aligned; tests also place
    it 8 bytes off), each through a temporary file renamed over it."""
    for shard in sorted(folder.glob("*.safetensors")):
        partial = shard.with_name(f".{shard.name}.partial")
        try:
            _write_aligned(shard, partial, data_start)
            os.replace(partial, shard)
        finally:
            partial.unlink(missing_ok=True)


def _write_aligned(shard: Path, out: Path, data_start: int = 0) -> None:
    read_header(shard)  # a clear CheckpointError for a file that is not a valid safetensors file
    with open(shard, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        raw = json.dumps(json.loads(f.read(length)), separators=(",", ":")).encode()
        raw += b" " * ((data_start - 8 - len(raw)) % DATA_ALIGN)
        with open(out, "wb") as g:
            g.write(struct.pack("<Q", len(raw)))
            g.write(raw)
            shutil.copyfileobj(f, g, _COPY_CHUNK)
