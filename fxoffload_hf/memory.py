"""What memory is free, and how big things are."""

from __future__ import annotations

import os
import threading

import psutil
import torch

from fxoffload_hf.memory_model import format_bytes as format_bytes  # one format everywhere
from fxoffload_hf.memory_model import nbytes


def free_host_memory() -> int:
    """Bytes of host RAM available to this process, honouring a cgroup limit when one is set."""
    available = psutil.virtual_memory().available
    limit = _cgroup_limit()
    if limit is not None:
        available = min(available, max(limit - _cgroup_usage(), 0))
    return int(available)


def memory_limit() -> int | None:
    """This process's memory-cgroup limit in bytes, or None when it has none."""
    return _cgroup_limit()


_M_MMAP_THRESHOLD = -3


def return_large_frees_to_the_os(threshold: int = 1 << 20) -> bool:
    """Make glibc serve allocations above ``threshold`` with mmap, so freeing them returns the memory.

    glibc otherwise raises its mmap threshold after the first large free, and the multi-megabyte weight
    buffers an offloaded model reads and drops then stay in the heap as holes: resident memory creeps
    past the budget. Process-wide, and the same as setting ``MALLOC_MMAP_THRESHOLD_``. False where the
    C library is not glibc.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def free_device_memory(device: torch.device) -> int:
    """Free bytes on a CUDA device (``torch.cuda.mem_get_info``)."""
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes the tensor's elements take once materialized (ghosts and views count in full)."""
    return nbytes(tensor.shape, tensor.element_size())


def process_status(keys: tuple[str, ...] = ("VmRSS", "VmHWM", "RssAnon", "RssFile")) -> dict[str, int]:
    """Memory lines of ``/proc/self/status`` in bytes: resident, its peak, private and file-backed."""
    out = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in keys:
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> None:
    """Reset the kernel's peak-resident mark (``VmHWM`` of ``/proc/self/status``) to the current size."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class PeakSampler:
    """A thread that samples :func:`process_status` every ``every`` seconds and keeps each key's peak.

    ``peak`` holds the peaks since the start or the last :meth:`reset`, ``peak_all`` those since the
    start. Use as a context manager, or call :meth:`start` and :meth:`stop`; both take a sample at once.
    """

    def __init__(self, keys: tuple[str, ...] = ("RssAnon", "RssFile"), every: float = 0.02) -> None:
        self.keys, self.every = keys, every
        self.peak = dict.fromkeys(keys, 0)
        self.peak_all = dict.fromkeys(keys, 0)
        self._lock = threading.Lock()
        self._window = 0  # bumped by ``reset``: a sample read before it is not folded into the new window
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="peak-sampler")

    def sample(self) -> dict[str, int]:
        """Read the keys now, fold them into the peaks, and return them."""
        window = self._window
        now = process_status(self.keys)
        with self._lock:
            for key, value in now.items():
                if window == self._window:
                    self.peak[key] = max(self.peak[key], value)
                self.peak_all[key] = max(self.peak_all[key], value)
        return now

    def reset(self, kernel_mark: bool = False) -> dict[str, int]:
        """Start a new peak window at the current values; with ``kernel_mark``, ``VmHWM``'s too."""
        if kernel_mark:
            reset_peak_rss()
        with self._lock:
            self._window += 1
            now = process_status(self.keys)
            self.peak.update(now)
        return now

    def start(self) -> PeakSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, with a last sample so that the peaks cover the time up to now."""
        self._stopped.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stopped.wait(self.every):
            self.sample()

    def __enter__(self) -> PeakSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _cgroup_limit() -> int | None:
    text = _cgroup_file("memory.limit_in_bytes", "memory.max")
    if text is None or text == "max":
        return None
    limit = int(text)
    return None if limit >= 2**60 else limit


def _cgroup_usage() -> int:
    text = _cgroup_file("memory.usage_in_bytes", "memory.current")
    return int(text) if text and text.isdigit() else 0


def _cgroup_file(v1_name: str, v2_name: str) -> str | None:
    """Read a file of this process's own memory cgroup (v1 or v2), or None."""
    try:
        with open("/proc/self/cgroup") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if controllers == "":
            candidate = os.path.join("/sys/fs/cgroup", path.lstrip("/"), v2_name)
        elif "memory" in controllers.split(","):
            candidate = os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), v1_name)
        else:
            continue
        if os.path.exists(candidate):
            with open(candidate) as file:
                return file.read().strip()
    return None
