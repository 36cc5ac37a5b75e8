"""cgroup v1 memory groups with a hard limit (root only), and whether they can be made here."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
MiB = 2**20


class MemoryCgroup:
    """A cgroup v1 memory group with a hard limit, removed on exit."""

    def __init__(self, name: str, limit: int, root: Path = CGROUP_ROOT) -> None:
        self.path = root / name
        self.limit = limit

    @property
    def procs(self) -> Path:
        """The file a process writes its pid to in order to join the group."""
        return self.path / "cgroup.procs"

    def __enter__(self) -> MemoryCgroup:
        if self.path.exists():
            self.path.rmdir()  # a leftover from an interrupted run (fails loudly if it still has tasks)
        self.path.mkdir()
        self.write("memory.limit_in_bytes", self.limit)
        return self

    def __exit__(self, *exc: object) -> None:
        for _ in range(50):
            with contextlib.suppress(OSError):
                self.write("memory.force_empty", 0)
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        print(f"warning: could not remove {self.path}", file=sys.stderr)

    def write(self, name: str, value: int) -> None:
        (self.path / name).write_text(str(value))

    def read_int(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def facts(self) -> dict[str, int]:
        """Peak usage (page cache included), failed charges, OOM kills, faults and page-ins."""
        out = {
            "max_usage": self.read_int("memory.max_usage_in_bytes"),
            "failcnt": self.read_int("memory.failcnt"),
        }
        out.update(_pick((self.path / "memory.oom_control").read_text(), {"oom_kill": "oom_kills"}))
        names = ("pgmajfault", "pgpgin", "cache", "rss", "mapped_file")
        out.update(_pick((self.path / "memory.stat").read_text(), {n: n for n in names}))
        return out


def _pick(text: str, keys: dict[str, str]) -> dict[str, int]:
    """From ``key value`` lines, the values of ``keys`` under their new names."""
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key in keys:
            out[keys[key]] = int(value)
    return out


def cgroups_writable(root: Path = CGROUP_ROOT) -> str | None:
    """None when memory cgroups can be made here, else why not."""
    if not (root / "cgroup.procs").exists():
        return f"{root} is not a cgroup v1 memory hierarchy"
    probe = root / f"fxoffload-bench-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(512 * MiB))
    except OSError as exc:
        return f"cannot create a memory cgroup under {root}: {exc}"
    finally:
        if probe.exists():
            probe.rmdir()
    return None
