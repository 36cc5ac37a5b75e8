"""A measured child's memory: ``process_status`` at named moments, and sampled peaks overall and per window.

Runs in the child only; ``fxoffload_hf.memory`` (and so torch) is imported on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.model import import_model_code

STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
PEAK_KEYS = ("RssAnon", "RssFile")


def status() -> dict[str, int]:
    """This process's memory lines of ``/proc/self/status``, in bytes."""
    from fxoffload_hf.memory import process_status

    return process_status(STATUS_KEYS)


def import_baseline(model_dir: Path) -> dict[str, int]:
    """This process's memory once it imported what the benchmarks' children import (accelerate,
    fxoffload_hf's transformers integration, the model's code) and ran torch.compile's one-time set-up
    (fxoffload is a torch.compile backend), before any model: the baseline a memory limit adds to."""
    import accelerate  # noqa: F401
    import torch

    import fxoffload_hf.integrations.transformers  # noqa: F401

    import_model_code(model_dir)
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(4))
    return status()


class MemoryMarks:
    """Snapshots of this process's memory at named moments, beside a :class:`PeakSampler` running all along.

    :meth:`window` starts the timed part: the sampler's peaks and the kernel's ``VmHWM`` restart there.
    """

    def __init__(self) -> None:
        from fxoffload_hf.memory import PeakSampler

        self.sampler = PeakSampler(PEAK_KEYS).start()
        self.marks: dict[str, dict[str, int]] = {}

    def mark(self, name: str) -> dict[str, int]:
        """Record the memory now as ``name``."""
        self.marks[name] = status()
        return self.marks[name]

    def window(self, name: str) -> None:
        """Restart the peaks, then record the memory now as ``name``."""
        self.sampler.reset(kernel_mark=True)
        self.mark(name)

    def finish(self, name: str = "end") -> dict[str, Any]:
        """Stop sampling, record ``name``; every mark, the window's peaks, the overall peaks."""
        self.sampler.stop()
        end = self.mark(name)
        peak, peak_all = self.sampler.peak, self.sampler.peak_all
        return {
            **self.marks,
            "peak_anon": peak["RssAnon"],
            "peak_file": peak["RssFile"],
            "peak_anon_overall": peak_all["RssAnon"],
            "peak_file_overall": peak_all["RssFile"],
            "vm_hwm_measure": end["VmHWM"],
        }
