"""The engine counts what each captured graph holds in host memory in a CPU budget."""

from __future__ import annotations

import pytest
import torch

from fxoffload_hf.memory_model import GRAPH_STATE_BYTES_PER_OP, BudgetTooSmallError


@pytest.mark.usefixtures("counted_graph_state")
def test_each_captured_graphs_state_is_counted_and_a_budget_below_it_is_refused_by_name(llama_ckpt):
    import fxoffload_hf

    folder, eager = llama_ckpt
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    model = fxoffload_hf.from_pretrained(folder, cpu_memory="256MiB", device="cpu")
    engine = fxoffload_hf.engine_of(model)
    assert engine.memory.graph_bytes == 0
    try:
        with torch.no_grad():
            got = model(ids, use_cache=False).logits
        counted = engine.memory.graph_bytes
        held = [h.memory for h in engine.memory_holders]
    finally:
        fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(got, eager(ids, use_cache=False).logits)
    assert counted > 0 and counted % GRAPH_STATE_BYTES_PER_OP == 0
    assert all(m is not None and m.graph_bytes == counted for m in held)  # every check sees it
    # a budget the weights alone would stream in, below the graph's state: refused, naming it
    tight = fxoffload_hf.from_pretrained(folder, cpu_memory=counted // 2, device="cpu")
    tight_engine = fxoffload_hf.engine_of(tight)
    try:
        with pytest.raises(BudgetTooSmallError, match="captured graphs' state") as refused, torch.no_grad():
            tight(ids, use_cache=False)
    finally:
        fxoffload_hf.restore(tight)
    assert refused.value.smallest_budget > counted
    # a generate's KV cache is blamed only where the rest fits without it
    with pytest.raises(BudgetTooSmallError, match="cannot hold the rest even without it"):
        tight_engine.expect_activations(1024, "a KV cache of 1 KiB")
    with pytest.raises(BudgetTooSmallError, match="ask for fewer new tokens"):
        engine.expect_activations(2**30, "a KV cache of 1 GiB")
