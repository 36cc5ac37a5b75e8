"""One validated configuration object for an offloaded model."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from fxoffload_hf.compile_cache import resolve_cache_dir
from fxoffload_hf.memory import free_device_memory, free_host_memory

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*|%)\s*$")
POLICIES = ("auto", "sequential")
DEFAULT_GPU_SHARE = 0.9
COMPILE_BACKENDS = (None, "inductor", "tensorrt")
# "first-call": capture at each entry point's first call; "deferred": run eagerly until worth capturing
CAPTURE_MODES = ("first-call", "deferred")
CAPTURE_ENV = "FXOFFLOAD_HF_CAPTURE"  # the capture mode where none is passed (default "deferred")
# "0": captured graphs' state is not counted in a CPU budget (tests that force many pieces with budgets
# below it set this); anything else, or unset, counts it
GRAPH_STATE_ENV = "FXOFFLOAD_HF_COUNT_GRAPH_STATE"
RESIDENT_THRESHOLD = 64 * 1024  # parameters smaller than this stay where the model computes

BudgetSpec = int | float | str | None


def counts_graph_state() -> bool:
    """Whether captured graphs' state is counted in a CPU budget (``$FXOFFLOAD_HF_COUNT_GRAPH_STATE``)."""
    return os.environ.get(GRAPH_STATE_ENV, "1") != "0"


def resolve_capture(capture: str | None) -> str:
    """The capture mode: ``capture``, or where it is None ``$FXOFFLOAD_HF_CAPTURE``, else ``"deferred"``."""
    source = "capture"
    if capture is None:
        capture = os.environ.get(CAPTURE_ENV) or "deferred"
        source = CAPTURE_ENV
    if capture not in CAPTURE_MODES:
        raise ValueError(f"{source}: {capture!r} is not one of {CAPTURE_MODES}")
    return capture


def parse_budget(value: BudgetSpec, *, free_bytes: int | None = None, what: str = "budget") -> int | None:
    """Turn a budget spec into bytes.

    Accepts ``None`` (no limit), a whole number of bytes, a float of bytes, a string with a
    unit (``"1.5GiB"``, ``"800MB"``, ``"4096"``) or a percentage of ``free_bytes`` (``"80%"``).

    Raises:
        ValueError: for negative, zero, non-finite or unparseable values.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected bytes, a size string or a percentage, got {value!r:.40}")
    if isinstance(value, int | float):
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{what}: {value!r:.40} is not a finite number of bytes")
        if value <= 0:
            raise ValueError(f"{what}: must be positive, got {value!r:.40}; pass None for no limit")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected bytes, a size string or a percentage, got {type(value).__name__}")
    match = _BUDGET_RE.match(value)
    if match is None:
        raise ValueError(
            f"{what}: cannot read {value!r:.40}; write bytes (1073741824), a size ('1.5GiB', '800MB') "
            "or a share of free memory ('80%')"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if number == float("inf"):
        raise ValueError(f"{what}: {value!r:.40} is too large to be a number of bytes")
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"{what}: a percentage must lie in (0, 100], got {value!r:.40}")
        if free_bytes is None:
            raise ValueError(
                f"{what}: {value!r:.40} is a share of free memory, but free memory is unknown here"
            )
        return int(free_bytes * number / 100)
    if unit not in _UNITS:
        raise ValueError(
            f"{what}: unknown unit {match.group(2)!r} in {value!r:.40}; use B, KB, MB, GB, KiB, MiB or GiB"
        )
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"{what}: must be positive, got {value!r:.40}; pass None for no limit")
    return nbytes


def parse_budgets(
    device_type: str, gpu_memory: BudgetSpec, cpu_memory: BudgetSpec, gpu_free: int | None
) -> tuple[int | None, int | None]:
    """``gpu_memory`` and ``cpu_memory`` in bytes. ``gpu_free`` is the compute device's free memory that
    shares are taken of (None: unknown, e.g. a GPU planned for on a machine without one); on CUDA without
    ``gpu_memory`` the budget is most of it, leaving room for the CUDA context and others."""
    gpu_budget = parse_budget(gpu_memory, free_bytes=gpu_free, what="gpu_memory")
    if gpu_budget is None and device_type == "cuda" and gpu_free is not None:
        gpu_budget = int(gpu_free * DEFAULT_GPU_SHARE)
    return gpu_budget, parse_budget(cpu_memory, free_bytes=free_host_memory(), what="cpu_memory")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means CUDA when available, else CPU; a CUDA device that is absent is an error."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: cannot read {device!r} ({exc}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device: {device!r} was asked for but CUDA is not available here; use device='cpu'"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device: {device!r} does not exist; this machine has {torch.cuda.device_count()} GPU(s)"
            )
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ValueError(f"device: {dev.type!r} is not supported; use 'cpu' or 'cuda'")
    return dev


@dataclass(frozen=True)
class OffloadConfig:
    """Budgets, tiers and policy for one offloaded model, validated once.

    ``gpu_memory`` bounds what the engine holds on the compute device (resident weights, the pieces in
    flight and activations). On a CPU-only run it sizes the pieces as if the device had that much memory.
    ``cpu_memory`` bounds the weights held in host RAM; weights beyond it stay on disk.
    """

    device: torch.device
    gpu_memory: int | None = None
    cpu_memory: int | None = None
    offload_folder: Path | None = None
    policy: str = "auto"
    compile: str | None = None
    capture: str = "deferred"
    resident_threshold: int = RESIDENT_THRESHOLD
    profile_calls: int = 1
    compile_cache: Path | None = None  # the compile cache's folder (``compile_cache``); None: off

    @classmethod
    def build(
        cls,
        *,
        gpu_memory: BudgetSpec = None,
        cpu_memory: BudgetSpec = None,
        offload_folder: str | os.PathLike[str] | None = None,
        device: str | torch.device | None = None,
        policy: str = "auto",
        compile: str | None = None,
        capture: str | None = None,
        compile_cache: bool | str | os.PathLike[str] | None = None,
    ) -> OffloadConfig:
        """Validate user-facing arguments (see ``fxoffload_hf.offload``) and build the config."""
        dev = resolve_device(device)
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {POLICIES}")
        if compile not in COMPILE_BACKENDS:
            raise ValueError(f"compile: {compile!r} is not one of {COMPILE_BACKENDS}")
        capture = resolve_capture(capture)
        gpu_free = free_device_memory(dev) if dev.type == "cuda" else free_host_memory()
        gpu_budget, cpu_budget = parse_budgets(dev.type, gpu_memory, cpu_memory, gpu_free)
        return cls(
            device=dev,
            gpu_memory=gpu_budget,
            cpu_memory=cpu_budget,
            offload_folder=Path(offload_folder) if offload_folder is not None else None,
            policy=policy,
            compile=compile,
            capture=capture,
            compile_cache=resolve_cache_dir(compile_cache, host_budget=cpu_budget is not None),
        )
