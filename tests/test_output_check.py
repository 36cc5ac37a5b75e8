"""NaN in a model's first eager calls warns: a weight was read outside the calls that are lent it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

import fxoffload_hf
from fxoffload_hf.output_check import CHECKED_CALLS, NaNOutputWarning, main_output


def test_the_main_output_is_the_logits_or_the_first_floating_tensor():
    logits, loss = torch.randn(2, 3), torch.tensor(1.0)
    assert main_output(CausalLMOutput(loss=loss, logits=logits)) is logits  # not the loss before them
    assert main_output((torch.ones(2, dtype=torch.long), (logits,))) is logits  # ids are no output
    assert main_output(logits) is logits and main_output(None) is None
    assert main_output({"tokens": torch.ones(2, dtype=torch.long)}) is None


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(256, 256)


class _ReadsAGrandchild(nn.Module):
    """Reads the weight of a child's child without calling either: a read fxoffload_hf does not lend."""

    def __init__(self) -> None:
        super().__init__()
        self.holder = _Holder()
        self.projection = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x) + x @ self.holder.table.weight


def test_a_weight_read_unlent_in_an_eager_call_warns_and_capture_serves_it(eager_calls_bounded):
    torch.manual_seed(0)
    model = _ReadsAGrandchild().eval()
    x = torch.randn(2, 256)
    with torch.no_grad():
        want = model(x)
    fxoffload_hf.offload(model, cpu_memory="8MiB", device="cpu", capture="deferred")
    try:
        with torch.no_grad(), pytest.warns(NaNOutputWarning, match='capture="first-call"'):
            assert torch.isnan(model(x)).all()  # the table's stand-in was read
        with torch.no_grad(), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(CHECKED_CALLS):
                model(x)
        # the first CHECKED_CALLS eager calls are looked at, no more (the look waits for the device)
        assert sum(isinstance(w.message, NaNOutputWarning) for w in seen) == CHECKED_CALLS - 1
    finally:
        fxoffload_hf.restore(model)
    fxoffload_hf.offload(model, cpu_memory="8MiB", device="cpu", capture="first-call")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", NaNOutputWarning)
            assert torch.equal(model(x), want)  # a captured graph is given every weight it reads
    finally:
        fxoffload_hf.restore(model)


def test_eager_calls_of_a_model_read_right_do_not_warn(tmp_path, save_checkpoint, default_capture):
    eager = save_checkpoint("llama", tmp_path)
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="1MiB", device="cpu")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", NaNOutputWarning)
            got = model.generate(ids, max_new_tokens=4, do_sample=False)
        with torch.no_grad():
            assert torch.equal(got, eager.generate(ids, max_new_tokens=4, do_sample=False))
        assert fxoffload_hf.engine_of(model).stats.eager_calls == 4  # all looked at
    finally:
        fxoffload_hf.restore(model)
