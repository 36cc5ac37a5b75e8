"""Per-piece compilation: Inductor on the CPU, and the TensorRT fallback where it is absent."""

from __future__ import annotations

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.integrations.piece_compilers import tensorrt_available


@pytest.mark.slow
def test_inductor_pieces_match_eager_within_tolerance(build_model, example_input):
    model = build_model("mlp")
    x = example_input("mlp")
    with torch.no_grad():
        expected = model(x)
    fxoffload_hf.offload(model, gpu_memory=1_200_000, device="cpu", compile="inductor")
    try:
        with torch.no_grad():
            out = model(x)
        assert fxoffload_hf.engine_of(model).runners[0].program.pieces >= 2
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.skipif(tensorrt_available(), reason="torch-tensorrt is installed")
def test_tensorrt_without_the_extra_warns_and_runs_eagerly(build_model, example_input):
    model = build_model("mlp")
    x = example_input("mlp")
    with torch.no_grad():
        expected = model(x)
    fxoffload_hf.offload(model, gpu_memory=1_200_000, device="cpu", compile="tensorrt")
    try:
        with pytest.warns(RuntimeWarning, match="tensorrt"), torch.no_grad():
            out = model(x)
        assert torch.equal(out, expected)
    finally:
        fxoffload_hf.restore(model)
