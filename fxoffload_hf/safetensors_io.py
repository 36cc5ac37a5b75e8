"""Read tensors from safetensors files in place: header parsing and positioned reads.

``safetensors`` itself loads a tensor by mapping the file, which leaves its pages in the page cache
(charged to the process's memory cgroup). The disk tier instead reads each tensor's byte range with
``os.preadv`` straight into a buffer it owns and then tells the kernel to drop those pages.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from fxoffload_hf.memory_model import nbytes

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or disagrees with the model."""


@dataclass(frozen=True)
class TensorSlice:
    """Where one tensor's bytes lie in a safetensors file."""

    path: Path
    key: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    signature: tuple[int, int, int] = (0, 0, 0)  # (inode, size, mtime ns) of the file when indexed


def read_header(path: str | os.PathLike[str]) -> dict[str, TensorSlice]:
    """Parse a safetensors header into absolute byte ranges, checking it against the file's size.

    Raises:
        CheckpointError: the file is missing, truncated, or its header is not valid safetensors.
    """
    path = Path(path)
    try:
        stat = path.stat()
        size = stat.st_size
        signature = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: too short to be a safetensors file; re-save or re-download it"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER, size - 8):
                raise CheckpointError(
                    f"{path}: corrupt safetensors header (declares {header_len} header bytes in a {size}-byte file); "
                    "re-download or re-save the checkpoint"
                )
            raw = handle.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path}: file not found; check the path or restore the missing shard"
        ) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: corrupt safetensors header ({exc}); re-download or re-save it"
        ) from None
    base = 8 + header_len
    slices: dict[str, TensorSlice] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            begin, end = (int(v) for v in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: corrupt entry for tensor {key!r} in the safetensors header"
            ) from None
        expected = nbytes(shape, dtype.itemsize)
        if end - begin != expected or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {key!r} declares bytes {begin}..{end} but needs {expected} and the file has "
                f"{size - base} data bytes; the file is truncated or corrupt"
            )
        slices[key] = TensorSlice(path, key, base + begin, end - begin, dtype, shape, signature)
    return slices


def read_into(slices: list[TensorSlice], buffers: list[torch.Tensor], *, drop_cache: bool = True) -> None:
    """Read each slice's bytes into the matching uint8 CPU buffer, coalescing adjacent ranges.

    Raises:
        CheckpointError: a file is missing or shorter than its header says.
    """
    order = sorted(range(len(slices)), key=lambda i: (str(slices[i].path), slices[i].offset))
    run: list[int] = []
    for i in order:
        if run:
            last = slices[run[-1]]
            if slices[i].path != last.path or slices[i].offset != last.offset + last.nbytes:
                _read_run([slices[j] for j in run], [buffers[j] for j in run], drop_cache)
                run = []
        run.append(i)
    if run:
        _read_run([slices[j] for j in run], [buffers[j] for j in run], drop_cache)


def _read_run(slices: list[TensorSlice], buffers: list[torch.Tensor], drop_cache: bool) -> None:
    path, start = slices[0].path, slices[0].offset
    total = sum(s.nbytes for s in slices)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found; restore the missing shard") from None
    try:
        check_unchanged(path, slices, os.fstat(fd))
        views = [memoryview(b.numpy()) for b in buffers]  # type: ignore[arg-type]
        done = 0
        while done < total:
            # preadv may return short; resume from where it stopped
            got = os.preadv(fd, _skip(views, done), start + done)
            if got == 0:
                raise CheckpointError(
                    f"{path}: ends before tensor {slices[0].key!r} does; the file was truncated or replaced"
                )
            done += got
        if drop_cache:
            os.posix_fadvise(fd, start, total, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def check_unchanged(path: Path, slices: list[TensorSlice], stat: os.stat_result) -> None:
    """Raise if ``path`` (now as ``stat`` says) changed since ``slices`` were indexed so that they no
    longer lie where they did. Free while the file's identity, size and time are the same; else its
    header is read again.

    Raises:
        CheckpointError: a tensor moved, changed shape or dtype, or is gone, or the file is corrupt now.
    """
    if (stat.st_ino, stat.st_size, stat.st_mtime_ns) == slices[0].signature:
        return
    now = read_header(path)
    for old in slices:
        new = now.get(old.key)
        if new is None or (new.offset, new.nbytes, new.dtype, new.shape) != (
            old.offset,
            old.nbytes,
            old.dtype,
            old.shape,
        ):
            raise CheckpointError(
                f"{old.path}: changed since the model was loaded (tensor {old.key!r} moved or is gone); "
                "restore the original file, or load the model again"
            )


def drop_cached_pages(paths: list[Path]) -> None:
    """Ask the kernel to drop the page cache of ``paths`` (clean pages only; nothing is lost)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _skip(views: list[memoryview], count: int) -> list[memoryview]:
    out = []
    for view in views:
        if count >= len(view):
            count -= len(view)
            continue
        out.append(view[count:])
        count = 0
    return out
