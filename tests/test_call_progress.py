"""A refusal in the middle of a call cut into graphs names the floor of the whole call (``call_progress``)."""

from __future__ import annotations

import pytest
import torch
import transformers

import fxoffload_hf
from fxoffload_hf.call_progress import CallProgress
from fxoffload_hf.memory_model import BudgetTooSmallError

WEIGHTS = [f"w{i}" for i in range(10)]


def test_the_rest_of_a_call_is_its_state_per_captured_weight_times_the_weights_still_to_come() -> None:
    graphs = [frozenset({"w0", "w1", "w2"})]  # captured by an earlier call
    progress = CallProgress(lambda: WEIGHTS, graphs)
    progress.starts()
    assert progress.rest_bytes() == 0  # nothing captured yet: nothing to scale by
    progress.captures({"w3", "w4"}, 1000)
    assert progress.rest_bytes() == 500 * 8  # 500 bytes per weight, w0..w2 and w5..w9 to come
    progress.ran(0)  # the earlier graph ran in this call: its weights are not to come
    assert progress.rest_bytes() == 500 * 5
    progress.expect(2)  # generate: this call and one more, a whole pass through the model
    progress.starts()
    progress.captures({"w3", "w4"}, 1000)
    assert progress.rest_bytes() == 500 * 8 + 500 * 10
    refusal = BudgetTooSmallError("too small: pass cpu_memory=100 or more", smallest_budget=100)
    named = progress.whole_call_refusal(refusal, "cpu_memory")
    assert named.smallest_budget == 100 + 9000 and "pass cpu_memory=9100 or more" in str(named)
    assert "pass cpu_memory=100 or more" not in str(named)


class _BreakingMLP(transformers.models.llama.modeling_llama.LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # as a mixture of experts routed by ``.tolist()`` breaks
        return super().forward(x)


@pytest.mark.usefixtures("counted_graph_state")
def test_the_budget_a_refusal_names_runs_a_call_cut_into_many_graphs(
    tmp_path, monkeypatch, deferred_run
) -> None:
    """A call that dynamo cuts into graphs at every layer, refused at its first graphs for their state,
    names a budget that runs it whole (not one refused again a few graphs later)."""
    from fxoffload_hf.align import align_shards_in_place

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    eager = transformers.LlamaForCausalLM(config).eval()
    eager.save_pretrained(tmp_path)
    align_shards_in_place(tmp_path)
    monkeypatch.setattr(transformers.models.llama.modeling_llama, "LlamaMLP", _BreakingMLP)
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    budget, refusals = 1_000_000, []
    for _ in range(2):
        model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu", capture="first-call")
        try:
            with torch.no_grad():
                got = model(ids).logits
            break
        except BudgetTooSmallError as refusal:
            refusals.append(refusal)
            budget = refusal.smallest_budget
        finally:
            graphs = len(fxoffload_hf.engine_of(model).runners)
            fxoffload_hf.restore(model)
    assert len(refusals) == 1 and "the graphs still to come hold about" in str(refusals[0])
    assert graphs > 4  # cut at every layer
    with torch.no_grad():
        assert torch.equal(got, eager(ids).logits)
    # the refusal names the other way too: deferred capture at the budget refused runs it as eager code
    assert 'capture="deferred" at this budget' in str(refusals[0])
    eagerly, eager_calls = deferred_run(tmp_path, 1_000_000, ids)
    assert torch.equal(eagerly, got) and eager_calls == 1
