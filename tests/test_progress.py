"""progress: one line per stage, through the ``fxoffload_hf`` logger."""

from __future__ import annotations

import logging

import torch

import fxoffload_hf
from fxoffload_hf import progress
from fxoffload_hf.progress import logger


def test_each_stage_reports_one_line(mlp_case, caplog):
    model, x, expected = mlp_case
    # once configured, our logger keeps its records (no propagation): pytest's handler goes on it
    progress.report("test starts")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="fxoffload_hf"):
            fxoffload_hf.offload(model, cpu_memory=400_000, device="cpu")
            with torch.no_grad():
                got = model(x)
                model(x)  # a steady call: no new lines
    finally:
        logger.removeHandler(caplog.handler)
        fxoffload_hf.restore(model)
    assert torch.equal(got, expected)
    lines = [r.getMessage() for r in caplog.records if r.name == "fxoffload_hf"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("weights placed for cpu: ") and "weights" in lines[0]
    assert lines[1].startswith("graph 1 captured ") and "cut into" in lines[1]
    assert lines[2].startswith("graph 1 profiled: ")
