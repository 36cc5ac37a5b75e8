"""progress: one line per stage, through the ``fxoffload_hf`` logger."""

from __future__ import annotations

import logging

import torch

import fxoffload_hf
from fxoffload_hf.progress import logger


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_each_stage_reports_one_line(mlp_case):
    model, x, expected = mlp_case
    lines = _Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        fxoffload_hf.offload(model, cpu_memory=400_000, device="cpu")
        with torch.no_grad():
            got = model(x)
            model(x)  # a steady call: no new lines
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
        fxoffload_hf.restore(model)
    assert torch.equal(got, expected)
    assert len(lines.lines) == 4, lines.lines
    assert lines.lines[0].startswith("weights placed for cpu: ") and "weights" in lines.lines[0]
    # at this budget a 256 KiB weight does not fit beside another piece
    assert lines.lines[1].startswith("too large to stream beside another piece, split into tiles: ")
    assert lines.lines[2].startswith("graph 1 captured ") and "cut into" in lines.lines[2]
    assert lines.lines[3].startswith("graph 1 profiled: ")
