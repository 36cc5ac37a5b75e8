"""Folders of our own in the system's temporary directory (spilled weights, Transformers' offload folder
for a load), each marked with the process that made it; making one removes those whose process is gone.

A process removes its folders when it restores or lets go of its model, or exits (``weakref.finalize``).
One killed outright (the kernel's OOM killer, a job's time limit: SIGKILL) runs none of that, and its
folder stays, with every weight it had spilled, until something clears the temporary directory (on many
machines, never). Only folders carrying our marker are removed, and only where its process surely no longer
runs: the same host and boot, the same process-id namespace (a container sharing the directory sees other
ids), and no process with that id started at that time (ids are reused).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import psutil

from fxoffload_hf.progress import report

PREFIX = "fxoffload-"  # every folder of ours begins so (``make``'s prefixes extend it)
_MARKER = ".fxoffload-owner"
_CLOCK_SLACK_S = 1.0  # start and boot times read twice may differ by a clock tick's rounding


def make(prefix: str = PREFIX) -> Path:
    """A new folder in the temporary directory, named from ``prefix`` (which begins with ``PREFIX``) and
    marked as this process's; folders of processes that are gone are removed first."""
    if not prefix.startswith(PREFIX):
        raise ValueError(f"a folder of ours begins with {PREFIX!r}, not {prefix!r}")
    remove_stale()
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    (folder / _MARKER).write_text(json.dumps(_this_process()))
    return folder


def remove_stale(root: Path | None = None) -> list[Path]:
    """Remove the folders of ours in ``root`` (the temporary directory) whose process no longer runs; the
    folders removed."""
    root = Path(tempfile.gettempdir()) if root is None else root
    me = _this_process()
    removed = []
    for folder in root.glob(f"{PREFIX}*"):
        owner = _owner(folder)
        if owner is None or _may_run(owner, me):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        report(
            "removed %d folder(s) in %s left by processes that were killed before they could remove them: %s",
            len(removed),
            root,
            ", ".join(f.name for f in removed),
        )
    return removed


def _this_process() -> dict[str, Any]:
    me = psutil.Process()
    return {
        "pid": me.pid,
        "started": me.create_time(),
        "host": socket.gethostname(),
        "boot": psutil.boot_time(),
        "pid_namespace": _pid_namespace(),
    }


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:  # not Linux: one namespace
        return ""


def _owner(folder: Path) -> dict[str, Any] | None:
    """The marker of a folder of ours; None for anything else (a file, a folder without one, one being
    made, a marker that cannot be read)."""
    try:
        owner = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _may_run(owner: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether the process ``owner`` describes may still run, as this process (``me``) sees it (where it
    cannot tell, it may)."""
    if owner.get("host") != me["host"] or owner.get("pid_namespace") != me["pid_namespace"]:
        return True
    pid, started, boot = owner.get("pid"), owner.get("started"), owner.get("boot")
    if not isinstance(pid, int) or not isinstance(started, int | float) or not isinstance(boot, int | float):
        return True
    if abs(boot - me["boot"]) > _CLOCK_SLACK_S:
        return False  # made before the machine last started: its process is gone
    try:
        return abs(psutil.Process(pid).create_time() - started) <= _CLOCK_SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # no permission to look: assume it runs
        return True
