"""Counting an eager call's torch operations: the size of the graph a capture of it would hold."""

from __future__ import annotations

import pytest
import torch

import fxoffload_hf
import fxoffload_hf.deferral
from fxoffload_hf import capture_forecast
from fxoffload_hf.eager_ops import OpCounter, uncounted


def test_the_counter_counts_functions_and_methods_but_not_what_is_left_out():
    x = torch.ones(3)
    counter = OpCounter()
    with counter:
        y = torch.add(x, 1).sum()  # a function and a method
        with uncounted():
            x * 2
    assert counter.ops == 2 and y.item() == 6.0
    idle = OpCounter(active=False)
    with idle:
        torch.add(x, 1)
        with uncounted():  # nothing counting: a no-op
            x * 2
    assert idle.ops == 0 and not torch._C._is_torch_function_mode_enabled()


@pytest.mark.usefixtures("counted_graph_state")
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_a_captured_graph_has_the_assumed_nodes_per_operation_counted(
    arch, tmp_path, save_checkpoint, logits, monkeypatch, backend_calls
):
    """``Deferral`` predicts a graph's state from the operations its eager call ran: the graph of the same
    call has at least ``_GRAPH_NODES_PER_OP`` nodes per operation counted (the eager fallback's lending
    left out), or captures that could fit would be skipped; and at most ``_GRAPH_NODES_PER_OP_MOST``, or a
    capture for speed could hold more than its share of the budget."""
    eager = save_checkpoint(arch, tmp_path)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(0))
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="1GiB", device="cpu", capture="deferred")
    engine = fxoffload_hf.engine_of(model)
    try:
        monkeypatch.setattr(fxoffload_hf.deferral, "_CAPTURE_SECONDS_PER_MODULE_CALL", 0.0)
        assert torch.equal(logits(model, ids), logits(eager, ids))  # eager, counted; capture next
        (ops,) = engine.deferral.forecast.recent_ops
        assert torch.equal(logits(model, ids), logits(eager, ids))  # captured
        (captured,) = backend_calls
        assert ops > 0 and captured >= capture_forecast._GRAPH_NODES_PER_OP * ops
        assert captured <= capture_forecast._GRAPH_NODES_PER_OP_MOST * ops
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.usefixtures("counted_graph_state")
def test_eager_calls_count_the_first_few_calls_then_one_in_so_many(tmp_path, save_checkpoint, monkeypatch):
    """Counting costs every operation a Python call: a budget that counts graphs' state counts the first
    ``_COUNTED_FIRST`` eager calls, then one in ``_COUNTED_EVERY``; a model without a budget none."""
    save_checkpoint("llama", tmp_path)
    ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(fxoffload_hf.deferral, "_CAPTURE_SECONDS_PER_MODULE_CALL", 1e9)  # no capture
    first, every = capture_forecast._COUNTED_FIRST, capture_forecast._COUNTED_EVERY
    for budget, counted in (("1GiB", first + 1), (None, 0)):
        model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu", capture="deferred")
        try:
            with torch.no_grad():
                for _ in range(every + 1):
                    model(ids)
            deferral = fxoffload_hf.engine_of(model).deferral
            assert deferral.stats.eager_calls == every + 1 and deferral.forecast.calls_counted == counted
        finally:
            fxoffload_hf.restore(model)
