"""progress: one line per stage, through the ``fxoffload_hf`` logger."""

from __future__ import annotations

import torch

import fxoffload_hf
from fxoffload_hf.memory_model import format_bytes


def test_each_stage_reports_one_line(mlp_case, report_lines):
    model, x, expected = mlp_case
    try:
        fxoffload_hf.offload(model, cpu_memory=400_000, device="cpu")
        stored = fxoffload_hf.engine_of(model).store.weights()  # the graph uses every one of them
        used = f"{len(stored)} weights ({format_bytes(sum(r.nbytes for r in stored))})"
        with torch.no_grad():
            got = model(x)
            model(x)  # a steady call: no new lines
    finally:
        fxoffload_hf.restore(model)
    assert torch.equal(got, expected)
    assert len(report_lines) == 4, report_lines
    assert report_lines[0].startswith("weights placed for cpu: ") and "weights" in report_lines[0]
    # at this budget a 256 KiB weight does not fit beside another piece
    assert report_lines[1].startswith("too large to stream beside another piece, split into tiles: ")
    assert report_lines[2].startswith("graph 1 captured ") and "cut into" in report_lines[2]
    assert used in report_lines[2]  # the model's weights it uses, each once, not their tiles
    assert report_lines[3].startswith("graph 1 profiled: ")
