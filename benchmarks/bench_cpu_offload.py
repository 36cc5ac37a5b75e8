"""CPU offload benchmark: eager, fxoffload_hf, accelerate on a ~1 GB fp32 Llama, with and without a memory limit.

Run ``.venv/bin/python benchmarks/bench_cpu_offload.py`` from the repository root. Each measurement runs in
its own child process (this script with ``--child MODE``) so that its memory figures are its own; the
parent imports no torch. Under ``/sys/fs/cgroup/memory`` (cgroup v1, needs root) the three modes are run
again with a hard limit of import baseline + budget + 128 MiB, beside a disk bound measured with plain
sequential reads. Compare figures only within one run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import importlib.metadata
import json
import os
import platform
import resource
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMELINE_ENV, TRACE_ENV = "FXOFFLOAD_BENCH_TIMELINE", "FXOFFLOAD_BENCH_TRACE"
MODES = ("eager", "fxoffload", "accelerate")
MiB = 2**20
MARK = "BENCH "  # prefix of the child's JSON lines on stdout
SEED = 0
PROMPT_TOKENS = 64
WARMUP_TOKENS = 4
BUDGET_SHARE = 0.25
LIMIT_SLACK = 128 * MiB
READ_CHUNK = 32 * MiB
BUSY_WARNING = 0.05  # warn when other processes took more than this share of the CPUs during a run
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
# the model: untied embeddings and head of 16000 x 1024 fp32 (65.5 MB each) are the largest weights
VOCAB, HIDDEN, INTERMEDIATE, HEADS = 16000, 1024, 2816, 16


# ---------------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------------
def llama_config(size_gb: float) -> dict[str, Any]:
    """A LlamaConfig (as keyword arguments) of about ``size_gb`` GB in fp32."""
    head_bytes = 2 * VOCAB * HIDDEN * 4
    layer_bytes = (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN) * 4
    layers = max(1, round((size_gb * 1e9 - head_bytes) / layer_bytes))
    return {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def checkpoint_facts(model_dir: Path) -> dict[str, Any]:
    """Shard count, total bytes and largest tensor, from the safetensors headers alone."""
    largest, tensors = 0, 0
    files = safetensors_files(model_dir)
    for file in files:
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                start, end = entry["data_offsets"]
                largest = max(largest, end - start)
                tensors += 1
    return {
        "dir": str(model_dir),
        "shards": len(files),
        "tensors": tensors,
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "largest_tensor_bytes": largest,
    }


def model_is_cached(model_dir: Path, config: dict[str, Any]) -> bool:
    meta = model_dir / "bench-meta.json"
    if not meta.exists() or not safetensors_files(model_dir):
        return False
    return json.loads(meta.read_text()) == {"seed": SEED, "config": config}


def child_build(model_dir: Path, size_gb: float) -> None:
    """Random-init (seeded) Llama saved in 200 MB shards; written aside, then renamed into place."""
    import shutil

    import torch
    import transformers

    config = llama_config(size_gb)
    torch.manual_seed(SEED)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    staging = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, max_shard_size="200MB")
    (staging / "bench-meta.json").write_text(json.dumps({"seed": SEED, "config": config}))
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(staging, model_dir)
    emit({"event": "built", "params": sum(p.numel() for p in model.parameters())})


# ---------------------------------------------------------------------------------------------------
# child: one mode, measured
# ---------------------------------------------------------------------------------------------------
def emit(record: dict[str, Any]) -> None:
    print(MARK + json.dumps(record), flush=True)


def proc_status() -> dict[str, int]:
    """Memory lines of /proc/self/status, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


class MemorySampler(threading.Thread):
    """Samples RssAnon / RssFile every ``interval`` seconds; keeps peaks overall and since ``reset``."""

    def __init__(self, interval: float = 0.02) -> None:
        super().__init__(daemon=True, name="memory-sampler")
        self.interval = interval
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.peak_all = dict(self.peak)

    def sample(self) -> None:
        now = proc_status()
        with self.lock:
            for key in self.peak:
                self.peak[key] = max(self.peak[key], now[key])
                self.peak_all[key] = max(self.peak_all[key], now[key])

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.sample()

    def reset(self) -> None:
        """Start a new peak window (and reset the kernel's VmHWM mark)."""
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        now = proc_status()
        with self.lock:
            self.peak = {key: now[key] for key in self.peak}

    def stop(self) -> None:
        self.sample()
        self.stopped.set()
        self.join()


class StepClock:
    """A logits processor that only records when each new token's scores arrive (and reports it)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.time())
        emit({"event": "token", "phase": self.phase, "step": len(self.times), "t": self.times[-1]})
        return scores

    def decode_rate(self) -> float | None:
        """Decode tokens per second: one over the median time of the steps after the first token (the
        first comes from prefill). The median, not the mean: one hiccup of a shared 2-core machine would
        otherwise move a 16-step figure by several percent, in either run of a comparison."""
        if len(self.times) < 2:
            return None
        return 1.0 / statistics.median(b - a for a, b in zip(self.times, self.times[1:], strict=False))


def load_model(mode: str, model_dir: Path, budget: int, offload_dir: Path) -> Any:
    import transformers

    if mode == "eager":
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if mode == "fxoffload":
        import fxoffload_hf

        return fxoffload_hf.from_pretrained(model_dir, offload="fx", cpu_memory=budget, device="cpu")
    if mode == "accelerate":
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(offload_dir)
        )
    raise ValueError(f"unknown mode {mode!r}")


def offload_engine(model: Any) -> Any | None:
    """The fxoffload_hf engine of ``model``, or None for a model fxoffload_hf does not run."""
    if "fxoffload_hf" not in sys.modules:
        return None
    import fxoffload_hf

    try:
        return fxoffload_hf.engine_of(model)
    except ValueError:
        return None


def child_run(mode: str, model_dir: Path, budget: int, new_tokens: int) -> None:
    """Load, warm up, then time one prefill forward and one greedy generate; emit one result line."""
    import tempfile

    sampler = MemorySampler()
    sampler.start()
    before_import = proc_status()
    import torch
    import transformers  # noqa: F401

    if mode == "fxoffload":
        import fxoffload_hf.integrations.transformers  # noqa: F401

    import_model_code(model_dir)
    after_import = proc_status()
    emit({"event": "phase", "phase": "load", "t": time.time()})
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as offload_dir:
        start = time.perf_counter()
        model = load_model(mode, model_dir, budget, Path(offload_dir))
        model.eval()
        load_s = time.perf_counter() - start
        after_load = proc_status()
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(SEED))
        mask = torch.ones_like(ids)
        gen = {"do_sample": False, "attention_mask": mask, "pad_token_id": 0}

        emit({"event": "phase", "phase": "warmup", "t": time.time()})
        start = time.perf_counter()
        with torch.no_grad():
            clock = StepClock("warmup")
            model.generate(
                ids,
                max_new_tokens=WARMUP_TOKENS,
                min_new_tokens=WARMUP_TOKENS,
                logits_processor=[clock],
                **gen,
            )
            model(input_ids=ids, attention_mask=mask)
        warmup_s = time.perf_counter() - start
        engine = offload_engine(model)
        engine_before = engine.stats.as_dict() if engine is not None else {}

        sampler.reset()
        measure_start = proc_status()
        emit({"event": "phase", "phase": "measure", "t": time.time()})
        recording = contextlib.nullcontext([])
        if engine is not None and (os.environ.get(TIMELINE_ENV) or os.environ.get(TRACE_ENV)):
            from fxoffload_hf.timeline import record_timeline

            recording = record_timeline(model)
        with torch.no_grad(), recording as events:
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            prefill_s = time.perf_counter() - start
            clock = StepClock("measure")
            start, started_at = time.perf_counter(), time.time()
            out = model.generate(
                ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, logits_processor=[clock], **gen
            )
            generate_s = time.perf_counter() - start
        if events:
            from fxoffload_hf.timeline import plot_timeline, write_chrome_trace

            if os.environ.get(TIMELINE_ENV):
                plot_timeline(
                    events, os.environ[TIMELINE_ENV], title="fxoffload_hf bench: prefill + generate"
                )
            if os.environ.get(TRACE_ENV):
                write_chrome_trace(events, os.environ[TRACE_ENV])
        sampler.stop()
        end = proc_status()
        result: dict[str, Any] = {
            "event": "result",
            "mode": mode,
            "load_s": load_s,
            "warmup_s": warmup_s,
            "prefill_s": prefill_s,
            "generate_s": generate_s,
            "first_token_s": clock.times[0] - started_at if clock.times else None,
            "decode_tok_s": clock.decode_rate(),
            "tokens": out[0, PROMPT_TOKENS:].tolist(),
            "threads": torch.get_num_threads(),
            "memory": {
                "before_import": before_import,
                "after_import": after_import,
                "after_load": after_load,
                "measure_start": measure_start,
                "end": end,
                "peak_anon": sampler.peak["RssAnon"],
                "peak_file": sampler.peak["RssFile"],
                "peak_anon_overall": sampler.peak_all["RssAnon"],
                "peak_file_overall": sampler.peak_all["RssFile"],
                "vm_hwm_measure": end["VmHWM"],
            },
        }
        if engine is not None:
            after = engine.stats.as_dict()
            result["engine"] = {
                "stats": after,
                "measure_delta": {
                    k: round(after[k] - engine_before[k], 4) for k in after if k != "hidden_copy_share"
                },
                "store": engine.store.summary(),
            }
        emit(result)


def import_model_code(model_dir: Path) -> None:
    """Import the model's modeling and generation code: code pages and module objects (about 90 MiB for
    Llama) are the same for every run and no part of the model's memory."""
    import transformers.generation  # noqa: F401

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def child_baseline(model_dir: Path) -> None:
    """Memory of a process that has imported everything the children import, before any model."""
    import accelerate  # noqa: F401
    import torch
    import transformers  # noqa: F401

    import fxoffload_hf.integrations.transformers  # noqa: F401

    import_model_code(model_dir)

    # torch.compile's one-time set-up (fxoffload is a torch.compile backend) belongs to the baseline too
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(4))
    emit({"event": "result", "memory": proc_status()})


# ---------------------------------------------------------------------------------------------------
# parent: children, cgroups, disk bound
# ---------------------------------------------------------------------------------------------------
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
        found = [e for e in self.events if e.get("event") in ("result", "built")]
        return found[-1] if found else None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""


def run_child(
    argv: list[str], timeout: float, log: Path, cgroup: MemoryCgroup | None = None, idle_wait: float = 0.0
) -> ChildRun:
    """Run this script as a child (in ``cgroup`` if given); kill its process group after ``timeout``.

    With ``idle_wait``, first wait up to that many seconds for the other processes to leave the CPUs idle.
    """
    cmd = [sys.executable, os.path.abspath(__file__), *argv]
    if cgroup is not None:
        # the shell puts itself in the cgroup, then becomes the child: every allocation is charged there
        cmd = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup.path / "cgroup.procs"), *cmd]
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    waited = wait_for_idle(idle_wait) if idle_wait > 0 else 0.0
    if waited > 10:
        print(f"  (waited {waited:.0f} s for other processes to leave the CPUs idle)", flush=True)
    start, busy = time.perf_counter(), cpu_busy()
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        run = ChildRun(None, False, 0.0, log=log)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(MARK):
                    run.events.append(json.loads(line[len(MARK) :]))
                else:
                    err.write(line)

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


def cpu_busy() -> tuple[float, float]:
    """(CPU seconds all processes were busy, CPU seconds of this process's finished children), now."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, children.ru_utime + children.ru_stime


def wait_for_idle(limit_s: float, window: float = 3.0) -> float:
    """Wait (at most ``limit_s``) until other processes use under BUSY_WARNING of the CPUs for ``window`` s."""
    start = time.perf_counter()
    while time.perf_counter() - start < limit_s:
        before, since = cpu_busy(), time.perf_counter()
        time.sleep(window)
        if other_cpu_share(before, since) < BUSY_WARNING:
            break
    return time.perf_counter() - start


def other_cpu_share(before: tuple[float, float], start: float) -> float:
    """Share of the machine's CPU time since ``before`` used by anything but this benchmark's child."""
    busy, children = cpu_busy()
    seconds = time.perf_counter() - start
    foreign = (busy - before[0]) - (children - before[1])
    return max(0.0, foreign / (seconds * (os.cpu_count() or 1)))


class MemoryCgroup:
    """A cgroup v1 memory group with a hard limit, removed on exit."""

    def __init__(self, name: str, limit: int) -> None:
        self.path = CGROUP_ROOT / name
        self.limit = limit

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
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                out["oom_kills"] = int(value)
        for line in (self.path / "memory.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("pgmajfault", "pgpgin", "cache", "rss", "mapped_file"):
                out[key] = int(value)
        return out


def cgroups_writable() -> str | None:
    """None when memory cgroups can be made here, else why not."""
    if not (CGROUP_ROOT / "cgroup.procs").exists():
        return f"{CGROUP_ROOT} is not a cgroup v1 memory hierarchy"
    probe = CGROUP_ROOT / f"fxoffload-bench-probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(512 * MiB))
    except OSError as exc:
        return f"cannot create a memory cgroup under {CGROUP_ROOT}: {exc}"
    finally:
        if probe.exists():
            probe.rmdir()
    return None


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False when not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        return False
    return True


def read_seconds(files: list[Path], nbytes: int) -> float:
    """Seconds to read the first ``nbytes`` of ``files`` with sequential 32 MiB preadv, after a cache drop."""
    drop_caches()
    view = memoryview(bytearray(READ_CHUNK))
    left = nbytes
    start = time.perf_counter()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            size, offset = os.fstat(fd).st_size, 0
            while left > 0 and offset < size:
                got = os.preadv(fd, [view[: min(READ_CHUNK, left, size - offset)]], offset)
                if got <= 0:
                    break
                os.posix_fadvise(fd, offset, got, os.POSIX_FADV_DONTNEED)
                offset, left = offset + got, left - got
        finally:
            os.close(fd)
        if left <= 0:
            break
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------
# parent: summary
# ---------------------------------------------------------------------------------------------------
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
        for phase in ("measure", "warmup"):
            steps = [e["t"] for e in run.events if e.get("event") == "token" and e["phase"] == phase]
            if steps:
                # k decode steps after the first token in the time until the kill: a lower bound
                row["decode_tok_s_lower_bound"] = (len(steps) - 1) / (run.killed_at - steps[0])
                row["lower_bound_phase"] = phase
                break
    if not run.timed_out:
        row["log_tail"] = run.log_tail()
    return row


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median decode rate among the rounds of one mode, with every round's rate."""
    done = sorted((r for r in rows if r.get("decode_tok_s")), key=lambda r: r["decode_tok_s"])
    if not done:
        return rows[0]
    chosen = dict(done[(len(done) - 1) // 2])
    chosen["decode_tok_s_rounds"] = [r.get("decode_tok_s") for r in rows]
    return chosen


def fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def decode_cell(row: dict[str, Any]) -> str:
    if row.get("status") == "ok":
        return fmt(row.get("decode_tok_s"))
    if "decode_tok_s_lower_bound" in row:
        return f">={row['decode_tok_s_lower_bound']:.2f} ({row['status']})"
    return row.get("status", "-")


def print_table(rows: list[tuple[str, str, dict[str, Any]]], eager_tokens: list[int] | None) -> None:
    header = (
        "mode",
        "limit",
        "prefill s",
        "decode tok/s",
        "peak private MiB",
        "peak file-backed MiB",
        "tokens = eager",
    )
    lines = [header]
    for mode, limit, row in rows:
        mem = row.get("memory") or {}
        equal = "-"
        if row.get("tokens") is not None and eager_tokens is not None:
            equal = "yes" if row["tokens"] == eager_tokens else "NO"
        lines.append(
            (
                mode,
                limit,
                fmt(row.get("prefill_s"), ".3f"),
                decode_cell(row),
                fmt(mem.get("peak_anon") and mem["peak_anon"] / MiB, ".0f"),
                fmt(mem.get("peak_file") and mem["peak_file"] / MiB, ".0f"),
                equal,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def paired_ratio(row: dict[str, Any], peer: dict[str, Any]) -> float | None:
    """The median over rounds of fxoffload's decode rate over the peer's in the same round. Runs of one round
    follow each other within a minute: a slow spell of a shared machine then weighs on both sides of a
    ratio, not on one mode's median only."""
    pairs = [
        a / b
        for a, b in zip(row.get("decode_tok_s_rounds", []), peer.get("decode_tok_s_rounds", []), strict=False)
        if a and b
    ]
    return statistics.median(pairs) if len(pairs) > 1 else None


def ratio_line(
    name: str, value: float | None, target: str, ok: bool | None, note: str = ""
) -> dict[str, Any]:
    verdict = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    print(f"  {name:<48} {fmt(value, '.3f'):>8}   target {target:<8} {verdict}{note}")
    return {"name": name, "value": value, "target": target, "pass": ok, "note": note.strip()}


def rate(row: dict[str, Any] | None) -> float | None:
    """Decode tokens/s of a run, or its lower bound after a timeout."""
    if row is None:
        return None
    return row.get("decode_tok_s") if row.get("status") == "ok" else row.get("decode_tok_s_lower_bound")


def targets(
    free: dict[str, dict[str, Any]], limited: dict[str, dict[str, Any]], bound: float | None, budget: int
) -> list[dict[str, Any]]:
    """The project's targets as ratios, printed and returned. A fxoffload run that failed fails its targets."""
    out = []
    # (name, runs, the peer's run or None, the peer's rate, least ratio)
    checks: list[tuple[str, dict[str, dict[str, Any]], dict[str, Any] | None, float | None, float]] = [
        ("decode tok/s fxoffload / eager", free, free.get("eager"), rate(free.get("eager")), 0.9),
        (
            "decode tok/s fxoffload / accelerate",
            free,
            free.get("accelerate"),
            rate(free.get("accelerate")),
            1.5,
        ),
    ]
    if limited:
        checks += [
            ("under limit: fxoffload / eager", limited, None, rate(limited.get("eager")), 1.0),
            ("under limit: fxoffload / accelerate", limited, None, rate(limited.get("accelerate")), 1.0),
            ("under limit: fxoffload / disk bound", limited, None, bound, 0.9),
        ]
    for name, runs, peer_row, peer, least in checks:
        row = runs.get("fxoffload")
        if row is None or peer is None:
            out.append(ratio_line(name, None, f">= {least:g}", None))
            continue
        fx = rate(row)
        if fx is None:
            out.append(ratio_line(name, None, f">= {least:g}", False, f" (fxoffload: {row['status']})"))
            continue
        partial = "" if row.get("status") == "ok" else f" (fxoffload lower bound: {row['status']})"
        value = fx / peer
        paired = paired_ratio(row, peer_row) if peer_row is not None else None
        if paired is not None:  # rounds ran side by side: compare each round's pair, then take the median
            partial += f" (median of the {len(row['decode_tok_s_rounds'])} rounds' ratios; ratio of medians {value:.3f})"
            value = paired
        out.append(ratio_line(name, value, f">= {least:g}", value >= least, partial))
    mem = (free.get("fxoffload") or {}).get("memory")
    if mem:
        rise = mem["peak_anon"] - mem["after_import"]["RssAnon"]
        out.append(
            ratio_line(
                "peak private rise over import / budget", rise / budget, "<= 1.15", rise / budget <= 1.15
            )
        )
        kept = mem["measure_start"]["RssAnon"] - mem["after_import"]["RssAnon"]
        out.append(ratio_line("  of which held after warm-up / budget", kept / budget, "(info)", None))
    return out


def machine() -> dict[str, Any]:
    """Platform, CPUs, RAM, load and package versions, for the report."""
    import psutil

    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "safetensors", "fxoffload_hf", "psutil"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "loadavg_at_start": os.getloadavg(),
        "versions": versions,
    }


# ---------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="model size in GB (fp32), default 1.0")
    parser.add_argument("--model-dir", type=Path, default=None, help="cache folder of the model (built once)")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated in the timed run")
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of the runs without a limit (median kept)"
    )
    parser.add_argument("--skip-limit", action="store_true", help="skip the runs under a cgroup memory limit")
    parser.add_argument(
        "--only", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}"
    )
    parser.add_argument("--limit-timeout", type=float, default=300.0, help="seconds per run under the limit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run without a limit")
    parser.add_argument(
        "--wait-idle", type=float, default=300.0, help="before each run, wait up to this long for idle CPUs"
    )
    parser.add_argument("--out", type=Path, default=Path("bench_results/bench_cpu_offload.json"))
    parser.add_argument(
        "--timeline", default=None, help="PNG of fxoffload's copy and compute per piece (no limit)"
    )
    parser.add_argument("--trace", default=None, help="the same as a Chrome trace (JSON) for Perfetto")
    parser.add_argument("--child", choices=(*MODES, "build", "baseline"), help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model_dir is None:
        args.model_dir = Path.home() / ".cache" / "fxoffload_hf" / f"bench-llama-{args.size_gb:g}g"
    args.model_dir = args.model_dir.expanduser().resolve()
    args.modes = [m.strip() for m in args.only.split(",") if m.strip()]
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--only: unknown modes {sorted(unknown)}; choose from {','.join(MODES)}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be at least 2 (the first token comes from prefill)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "build":
        child_build(args.model_dir, args.size_gb)
        return 0
    if args.child == "baseline":
        child_baseline(args.model_dir)
        return 0
    if args.child:
        child_run(args.child, args.model_dir, args.budget, args.new_tokens)
        return 0

    wall = time.perf_counter()
    logs = args.out.parent / "logs"
    config = llama_config(args.size_gb)
    if not model_is_cached(args.model_dir, config):
        print(f"building the model in {args.model_dir} ...", flush=True)
        args.model_dir.parent.mkdir(parents=True, exist_ok=True)
        built = run_child(
            ["--child", "build", "--model-dir", str(args.model_dir), "--size-gb", str(args.size_gb)],
            1800,
            logs / "build.log",
        )
        if built.returncode != 0:
            print(f"building the model failed:\n{built.log_tail()}", file=sys.stderr)
            return 1
    facts = checkpoint_facts(args.model_dir)
    total = facts["checkpoint_bytes"]
    budget = int(total * BUDGET_SHARE)
    print(f"model: LlamaForCausalLM {json.dumps(config)}")
    print(
        f"checkpoint: {total / 1e6:.0f} MB in {facts['shards']} shards, largest tensor "
        f"{facts['largest_tensor_bytes'] / 1e6:.1f} MB; budget {BUDGET_SHARE:.0%} = {budget / MiB:.0f} MiB; "
        f"prompt {PROMPT_TOKENS} tokens, greedy, {args.new_tokens} new tokens (warm-up {WARMUP_TOKENS})",
        flush=True,
    )
    if args.timeline:
        os.environ[TIMELINE_ENV] = str(Path(args.timeline).resolve())
    if args.trace:
        os.environ[TRACE_ENV] = str(Path(args.trace).resolve())
    child_args = [
        "--model-dir",
        str(args.model_dir),
        "--budget",
        str(budget),
        "--new-tokens",
        str(args.new_tokens),
    ]
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "machine": machine(),
        "model": {"class": "LlamaForCausalLM", "config": config, "seed": SEED, **facts},
        "settings": {
            "budget_bytes": budget,
            "budget_share": BUDGET_SHARE,
            "prompt_tokens": PROMPT_TOKENS,
            "warmup_tokens": WARMUP_TOKENS,
            "new_tokens": args.new_tokens,
            "limit_slack_bytes": LIMIT_SLACK,
        },
        "free": {},
        "limited": {},
    }

    rows: list[tuple[str, str, dict[str, Any]]] = []
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for round_index in range(args.rounds):  # interleaved, so a slow spell of the machine hits every mode
        for mode in args.modes:
            print(
                f"[{time.perf_counter() - wall:6.0f}s] {mode}, no limit (round {round_index + 1}/{args.rounds}) ...",
                flush=True,
            )
            drop_caches()
            runs[mode].append(
                summarize(
                    run_child(
                        ["--child", mode, *child_args],
                        args.timeout,
                        logs / f"{mode}-{round_index}.log",
                        None,
                        args.wait_idle,
                    )
                )
            )
    for mode in args.modes:
        row = median_run(runs[mode])
        report["free"][mode] = row
        rows.append((mode, "none", row))
    eager_tokens = report["free"].get("eager", {}).get("tokens")

    bound = None
    why_not = "--skip-limit" if args.skip_limit else cgroups_writable()
    if why_not is not None:
        print(f"skipping the runs under a memory limit: {why_not}")
        report["limited_skipped"] = why_not
    else:
        os.environ.pop(TIMELINE_ENV, None)  # pictures are of the run without a limit
        os.environ.pop(TRACE_ENV, None)
        base = run_child(
            ["--child", "baseline", "--model-dir", str(args.model_dir)], 300, logs / "baseline.log"
        ).result
        if base is None:
            print("the baseline child failed; skipping the runs under a memory limit", file=sys.stderr)
            report["limited_skipped"] = "baseline child failed"
        else:
            baseline = base["memory"]["VmRSS"]
            limit = baseline + budget + LIMIT_SLACK
            streamed = total - budget
            wait_for_idle(args.wait_idle)
            reads = [read_seconds(safetensors_files(args.model_dir), streamed) for _ in range(3)]
            read_s = statistics.median(reads)
            eager_rate = rate(report["free"].get("eager"))
            bound = 1 / (read_s + 1 / eager_rate) if eager_rate else None
            report["limit"] = {
                "baseline_vmrss_bytes": baseline,
                "baseline_memory": base["memory"],
                "limit_bytes": limit,
                "formula": "import baseline VmRSS + budget + 128 MiB",
            }
            report["disk_bound"] = {
                "streamed_bytes_per_token": streamed,
                "read_seconds": reads,
                "read_seconds_median": read_s,
                "read_mb_s": streamed / read_s / 1e6,
                "eager_compute_seconds_per_token": 1 / eager_rate if eager_rate else None,
                "tok_s": bound,
                "method": "sequential 32 MiB os.preadv after drop_caches, POSIX_FADV_DONTNEED after each read",
            }
            print(
                f"limit: baseline {baseline / MiB:.0f} MiB + budget {budget / MiB:.0f} MiB + 128 MiB = "
                f"{limit / MiB:.0f} MiB; disk: {streamed / 1e6:.0f} MB/token in {read_s:.3f} s "
                f"({streamed / read_s / 1e6:.0f} MB/s), bound {fmt(bound)} tok/s",
                flush=True,
            )
            for mode in args.modes:
                print(
                    f"[{time.perf_counter() - wall:6.0f}s] {mode}, limit {limit / MiB:.0f} MiB ...",
                    flush=True,
                )
                with MemoryCgroup(f"fxoffload-bench-{mode}", limit) as group:
                    drop_caches()
                    run = run_child(
                        ["--child", mode, *child_args],
                        args.limit_timeout,
                        logs / f"{mode}-limited.log",
                        group,
                        args.wait_idle,
                    )
                    row = summarize(run)
                    row["cgroup"] = group.facts()
                if row["cgroup"].get("oom_kills") and run.returncode == -signal.SIGKILL:
                    row["status"] = row["status"].replace(f"failed (rc={run.returncode})", "OOM-killed")
                report["limited"][mode] = row
                rows.append((mode, f"{limit / MiB:.0f} MiB", row))

    print()
    print_table(rows, eager_tokens)
    for mode, row in report["free"].items():
        rates = ", ".join(fmt(r) for r in row.get("decode_tok_s_rounds", []))
        if rates:
            print(f"{mode} without a limit, decode tok/s by round: {rates} (the median run is shown)")
    print(
        "(decode tok/s = 1 / median decode step time; peak private = max RssAnon, peak file-backed = max RssFile, sampled every 20 ms over the timed prefill "
        "and generate; both include the import baseline)"
    )
    if bound is not None:
        print(
            f"{'disk bound':<10}  {report['limit']['limit_bytes'] / MiB:.0f} MiB  decode tok/s <= {bound:.2f}"
        )
    for mode, limit, row in rows:
        if row.get("status") != "ok":
            last = (row.get("log_tail") or "").strip().splitlines()[-1:]
            print(f"note: {mode} (limit {limit}): {row['status']}" + (f": {last[0]}" if last else ""))
        if row.get("foreign_cpu_share", 0) > BUSY_WARNING:
            print(
                f"WARNING: {mode} (limit {limit}): other processes used {row['foreign_cpu_share']:.0%} of the CPUs "
                "meanwhile; its figures are not those of an idle machine"
            )
        if row.get("engine"):
            print(
                f"fxoffload engine (limit {limit}): {row['engine']['store']}; measured: {row['engine']['measure_delta']}"
            )
    print("\ntargets:")
    report["targets"] = targets(report["free"], report["limited"], bound, budget)
    report["wall_seconds"] = round(time.perf_counter() - wall, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out} ({report['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
