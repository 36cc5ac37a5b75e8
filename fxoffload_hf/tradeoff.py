"""Predicted decode speed at a budget, from sizes and bandwidths (pure: no torch, no IO).

Decoding one token reads every weight once. What the budget cannot keep where the model computes streams
in for each token, from host memory or from disk, behind the compute (copy and compute overlap, so a
token takes the longer of the two). The bandwidths are assumptions a user can replace with measured ones.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class Bandwidths:
    """Bytes per second of each path (defaults: a typical NVMe disk, PCIe 4 x16, DDR5 and HBM3)."""

    disk: float = 3 * GB
    link: float = 25 * GB  # host memory to the GPU
    cpu_memory: float = 40 * GB  # the CPU reading weights it computes with
    gpu_memory: float = 2000 * GB

    def compute(self, device_type: str) -> float:
        """How fast the compute device reads the weights it multiplies with (decode is bound by it)."""
        return self.gpu_memory if device_type == "cuda" else self.cpu_memory


@dataclass(frozen=True)
class Estimate:
    """Where the weights lie at one budget, and the decode speed that gives."""

    budget: int
    resident: int  # weights kept where the model computes
    from_host: int  # streamed each token from host memory
    from_disk: int  # streamed each token from disk
    seconds_per_token: float

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.seconds_per_token if self.seconds_per_token > 0 else float("inf")


def estimate(
    budget: int,
    *,
    weights: int,
    fixed: int,
    activations: int,
    in_flight: int,
    device_type: str,
    host_budget: int | None,
    bandwidths: Bandwidths,
) -> Estimate:
    """The decode speed at ``budget`` where the model computes (``host_budget``: the weights host memory
    may hold on a GPU run; None: all)."""
    room = max(budget - fixed - activations, 0)
    resident = weights if room >= weights else max(min(room - in_flight, weights), 0)
    streamed = weights - resident
    if device_type == "cuda":
        from_host = streamed if host_budget is None else min(streamed, host_budget)
        copy = from_host / bandwidths.link + (streamed - from_host) / bandwidths.disk
    else:
        from_host = 0  # on the CPU, what the budget does not hold is read from the file each time
        copy = streamed / bandwidths.disk
    compute = weights / bandwidths.compute(device_type)
    return Estimate(budget, resident, from_host, streamed - from_host, max(compute, copy))


def budgets_between(floor: int, full: int, steps: int = 4) -> list[int]:
    """``floor``, then evenly spaced budgets up to ``full`` (everything resident), without repeats."""
    if full <= floor:
        return [floor]
    values = [floor + (full - floor) * i // steps for i in range(steps + 1)]
    return sorted(set(values))
