"""Pictures of the overlap: each piece's copy and compute over time, as a PNG or a Chrome trace."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from fxoffload_hf.api import engine_of
from fxoffload_hf.observers import TraceEvent, TraceRecorder


@contextmanager
def record_timeline(model: nn.Module) -> Iterator[list[TraceEvent]]:
    """Record every piece run of an offloaded model inside the ``with`` block."""
    engine = engine_of(model)
    events: list[TraceEvent] = []
    with engine.observing(TraceRecorder(events, lambda: engine.stats.calls)):
        yield events


def chrome_trace(events: list[TraceEvent]) -> dict[str, Any]:
    """Events in the Chrome trace format (Perfetto opens it): a copy track and a compute track."""
    if not events:
        return {"traceEvents": []}
    origin = min(min(e.timing.copy_start, e.timing.compute_start) for e in events)
    out = []
    for event in events:
        t = event.timing
        args = {"graph": event.graph, "call": event.call, "piece": t.piece, "bytes": event.streamed_bytes}
        args["alone"] = event.alone
        copy_name = f"copy {t.piece} (alone: too large to overlap)" if event.alone else f"copy {t.piece}"
        for track, name, start, end in (
            (1, copy_name, t.copy_start, t.copy_end),
            (2, f"compute {t.piece}", t.compute_start, t.compute_end),
        ):
            if track == 1 and not event.streamed_bytes:
                continue
            out.append(
                {"name": name, "ph": "X", "pid": 1, "tid": track, "ts": (start - origin) * 1e6,
                 "dur": max(end - start, 0) * 1e6, "args": args}
            )  # fmt: skip
    meta = [
        {
            "name": "thread_name",
            "ph": "M",
            "pid": 1,
            "tid": 1,
            "args": {"name": "copy (disk/host -> device)"},
        },
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 2, "args": {"name": "compute"}},
    ]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: list[TraceEvent], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(events)))
    return path


def plot_timeline(events: list[TraceEvent], path: str | Path, title: str = "fxoffload_hf timeline") -> Path:
    """Draw copy and compute bars per piece over time (matplotlib, imported here only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(12, 3.2))
    if events:
        origin = min(min(e.timing.copy_start, e.timing.compute_start) for e in events)
        for event in events:
            t = event.timing
            if event.streamed_bytes:
                ax.barh(
                    1,
                    (t.copy_end - t.copy_start) * 1e3,
                    left=(t.copy_start - origin) * 1e3,
                    color="tab:red" if event.alone else "tab:orange",  # red: streamed alone, not hidden
                )
            ax.barh(
                0,
                (t.compute_end - t.compute_start) * 1e3,
                left=(t.compute_start - origin) * 1e3,
                color="tab:blue",
            )
    ax.set_yticks([0, 1], ["compute", "copy"])
    ax.set_xlabel("milliseconds")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
