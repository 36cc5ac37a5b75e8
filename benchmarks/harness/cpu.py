"""How much of the CPUs other processes use, and waiting until they leave them idle."""

from __future__ import annotations

import os
import resource
import time

BUSY_WARNING = 0.05  # warn when other processes took more than this share of the CPUs during a run


def cpu_busy() -> tuple[float, float]:
    """(CPU seconds all processes were busy, CPU seconds of this process's finished children), now."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def other_cpu_share(before: tuple[float, float], start: float) -> float:
    """Share of the machine's CPU time since ``before`` used by anything but this benchmark's children."""
    busy, children = cpu_busy()
    seconds = time.perf_counter() - start
    foreign = (busy - before[0]) - (children - before[1])
    return max(0.0, foreign / (seconds * (os.cpu_count() or 1)))


def wait_for_idle(limit_s: float, window: float = 3.0) -> float:
    """Wait (at most ``limit_s``) until other processes use under BUSY_WARNING of the CPUs for ``window`` s."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        before, since = cpu_busy(), time.perf_counter()
        time.sleep(window)
        if other_cpu_share(before, since) < BUSY_WARNING:
            break
    return time.perf_counter() - start
