"""Parent side of a benchmark's children: spawn one (in a cgroup, after idle CPUs), collect its records."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import model
from harness.cgroup import MemoryCgroup, cgroups_writable
from harness.cpu import cpu_busy, other_cpu_share, wait_for_idle
from harness.protocol import emit, parse
from harness.sampling import import_baseline

CHILD_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class ChildRun:
    """What came back from one child: its JSON lines, exit code, whether it was killed on a timeout."""

    returncode: int | None
    timed_out: bool
    seconds: float
    events: list[dict[str, Any]] = field(default_factory=list)
    log: Path | None = None
    killed_at: float | None = None
    foreign_cpu_share: float = 0.0  # CPU used by other processes meanwhile, as a share of all cores

    @property
    def result(self) -> dict[str, Any] | None:
        """The child's last result (or ``built``) record."""
        found = [e for e in self.events if e.get("event") in ("result", "built")]
        return found[-1] if found else None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the child's stderr (and stray stdout)."""
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""


def run_child(
    script: Path,
    argv: list[str],
    timeout: float,
    log: Path,
    cgroup: MemoryCgroup | None = None,
    idle_wait: float = 0.0,
) -> ChildRun:
    """Run ``script`` with ``argv`` as a child (in ``cgroup`` if given); kill its process group after ``timeout``.

    With ``idle_wait``, first wait up to that many seconds for the other processes to leave the CPUs idle.
    """
    cmd = [sys.executable, str(script), *argv]
    if cgroup is not None:
        # the shell puts itself in the cgroup, then becomes the child: every allocation is charged there
        cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.procs), *cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    waited = wait_for_idle(idle_wait) if idle_wait > 0 else 0.0
    if waited > 10:
        print(f"  (waited {waited:.0f} s for other processes to leave the CPUs idle)", flush=True)
    start, busy = time.perf_counter(), cpu_busy()
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **CHILD_ENV},
            start_new_session=True,
        )
        run = ChildRun(None, False, 0.0, log=log)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                record = parse(line)
                if record is None:
                    err.write(line)
                else:
                    run.events.append(record)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.timed_out, run.killed_at = True, time.time()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=10)
    run.returncode, run.seconds = proc.returncode, time.perf_counter() - start
    run.foreign_cpu_share = other_cpu_share(busy, start)
    return run


def summarize(run: ChildRun) -> dict[str, Any]:
    """A row for the table (and the JSON): the child's result, or why there is none."""
    row: dict[str, Any] = {
        "returncode": run.returncode,
        "timed_out": run.timed_out,
        "wall_s": round(run.seconds, 2),
        "foreign_cpu_share": round(run.foreign_cpu_share, 3),
    }
    result = run.result
    if result is not None and run.returncode == 0:
        row.update({k: v for k, v in result.items() if k != "event"})
        row["status"] = "ok"
        return row
    phases = [e for e in run.events if e.get("event") == "phase"]
    row["status"] = ("timeout" if run.timed_out else f"failed (rc={run.returncode})") + (
        f" in {phases[-1]['phase']}" if phases else ""
    )
    if run.timed_out and run.killed_at is not None:
        row.update(lower_bound(run.events, run.killed_at))
    if not run.timed_out:
        row["log_tail"] = run.log_tail()
    return row


def lower_bound(events: list[dict[str, Any]], killed_at: float) -> dict[str, Any]:
    """After a kill: k decode steps after the first token in the time until the kill, a lower bound on the
    decode rate, from the timed phase's tokens or else the warm-up's; empty when neither has a token."""
    for phase in ("measure", "warmup"):
        steps = [e["t"] for e in events if e.get("event") == "token" and e["phase"] == phase]
        if steps:
            return {
                "decode_tok_s_lower_bound": (len(steps) - 1) / (killed_at - steps[0]),
                "lower_bound_phase": phase,
            }
    return {}


def limited_row(name: str, limit: int, run: Callable[[MemoryCgroup], ChildRun]) -> dict[str, Any]:
    """``run`` a child in a fresh memory cgroup ``name`` with a hard ``limit``: its row, with the group's
    facts, and a kill by the OOM killer named as such."""
    with MemoryCgroup(name, limit) as group:
        done = run(group)
        row = summarize(done)
        row["cgroup"] = group.facts()
    if row["cgroup"].get("oom_kills") and done.returncode == -signal.SIGKILL:
        row["status"] = row["status"].replace(f"failed (rc={done.returncode})", "OOM-killed")
    return row


def mode_row(
    script: Path, argv: list[str], log: Path, timeout: float, wait_idle: float, limit: int | None, group: str
) -> dict[str, Any]:
    """One run of a mode as a row: ``script`` with ``argv`` as a child, in a fresh cgroup ``group`` with a
    hard ``limit`` when one is given."""
    if limit is None:
        return summarize(run_child(script, argv, timeout, log, None, wait_idle))
    return limited_row(group, limit, lambda cgroup: run_child(script, argv, timeout, log, cgroup, wait_idle))


def build_once(script: Path, model_dir: Path, config: dict[str, Any], argv: list[str], log: Path) -> bool:
    """Have ``script`` build the benchmark's model in ``model_dir`` (a child ``--child build`` with
    ``argv``) unless a copy of ``config`` is there; False, with the child's log printed, if it failed."""
    if model.model_is_cached(model_dir, config):
        return True
    print(f"building the model in {model_dir} ...", flush=True)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    built = run_child(script, ["--child", "build", "--model-dir", str(model_dir), *argv], 1800, log)
    if built.returncode != 0:
        print(f"building the model failed:\n{built.log_tail()}", file=sys.stderr)
        return False
    return True


def add_child_options(parser: argparse.ArgumentParser, modes: Iterable[str] | None = None) -> None:
    """The hidden options by which a benchmark runs its own script as a child (``serve_child``): the
    child's task (one of ``modes``, ``build`` or ``baseline`` where ``modes`` are given) and its budget."""
    choices = (*modes, "build", "baseline") if modes is not None else None
    parser.add_argument("--child", default=None, choices=choices, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)


def serve_child(
    child: str | None,
    model_dir: Path,
    config: dict[str, Any],
    run: Callable[[str], None],
    baseline: Callable[[Path], dict[str, int]] = import_baseline,
) -> bool:
    """Do what ``--child`` asks of a benchmark's own script: build the model of ``config`` in
    ``model_dir``, measure the import ``baseline``, or ``run`` that mode; whether it was a child."""
    if child is None:
        return False
    if child == "build":
        emit({"event": "built", **model.build(model_dir, config)})
    elif child == "baseline":
        emit({"event": "result", "memory": baseline(model_dir)})
    else:
        run(child)
    return True


def limit_baseline(script: Path, model_dir: Path, log: Path) -> tuple[dict[str, int] | None, str | None]:
    """The import baseline a memory limit adds to (``script --child baseline``'s memory), or why there
    is no limit (cgroups not writable, or the child failed)."""
    why_not = cgroups_writable()
    if why_not is not None:
        return None, why_not
    base = run_child(script, ["--child", "baseline", "--model-dir", str(model_dir)], 300, log)
    return (base.result["memory"], None) if base.result is not None else (None, "the baseline child failed")
