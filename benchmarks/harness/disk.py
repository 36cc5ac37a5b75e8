"""The page cache and the disk: dropping the cache, timing plain reads, the read bound on decoding."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

READ_CHUNK = 32 * 2**20
READ_METHOD = "sequential 32 MiB os.preadv after drop_caches, POSIX_FADV_DONTNEED after each read"


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def read_seconds(files: list[Path], nbytes: int, chunk: int = READ_CHUNK) -> float:
    """Seconds to read the first ``nbytes`` of ``files`` with sequential ``chunk`` preadv, after a cache drop."""
    drop_caches()
    view = memoryview(bytearray(chunk))
    left = nbytes
    start = time.perf_counter()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            size, offset = os.fstat(fd).st_size, 0
            while left > 0 and offset < size:
                got = os.preadv(fd, [view[: min(chunk, left, size - offset)]], offset)
                if got <= 0:
                    break
                os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
                offset, left = offset + got, left - got
        finally:
            os.close(fd)
        if left <= 0:
            break
    return time.perf_counter() - start


def decode_bound(read_s: float, compute_rate: float | None) -> float | None:
    """Tokens/s of a decoder that reads for ``read_s`` and then computes at ``compute_rate`` tokens/s, each
    token; None without a compute rate."""
    return 1 / (read_s + 1 / compute_rate) if compute_rate else None


def measure_bound(
    files: list[Path], nbytes: int, compute_rate: float | None, repeats: int = 3
) -> dict[str, Any]:
    """Time reading ``nbytes`` of ``files`` ``repeats`` times: the median, and the decode bound of a model
    that streams ``nbytes`` a token and otherwise computes at ``compute_rate`` tokens/s."""
    reads = [read_seconds(files, nbytes) for _ in range(repeats)]
    read_s = statistics.median(reads)
    return {
        "streamed_bytes_per_token": nbytes,
        "read_seconds": reads,
        "read_seconds_median": read_s,
        "read_mb_s": nbytes / read_s / 1e6,
        "eager_compute_seconds_per_token": 1 / compute_rate if compute_rate else None,
        "tok_s": decode_bound(read_s, compute_rate),
        "method": READ_METHOD,
    }
