"""plan's smallest budget of eager calls: where the default (deferred) capture starts to run calls eagerly."""

from __future__ import annotations

import torch

import fxoffload_hf
from fxoffload_hf.memory_model import BudgetTooSmallError
from fxoffload_hf.plan import plan_checkpoint

_TABLE = 32000 * 256 * 4


def _ran_eagerly(folder, budget: int, ids: torch.Tensor, expected: torch.Tensor, logits) -> bool:
    """Whether a call of ``ids`` at ``budget`` ran as eager code (exactly, either way)."""
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=budget, device="cpu", capture="deferred")
    try:
        assert torch.equal(logits(model, ids), expected)
        return fxoffload_hf.engine_of(model).stats.eager_calls == 1
    except BudgetTooSmallError:
        return False  # captured, and refused: not eager either
    finally:
        fxoffload_hf.restore(model)


def test_the_eager_floor_is_where_eager_calls_start_to_fit(tmp_path, save_checkpoint, logits):
    """Vocab 32,000 against hidden 256: eager calls fit far below the output head, lent a tile of rows at a
    time; at the planned floor a call of the planned length runs eagerly, a little below it does not."""
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    report = plan_checkpoint(tmp_path, cpu_memory="1GiB", seq_len=16)
    floor = report.eager_budget
    assert floor is not None and floor < _TABLE and "in tiles of" in report.eager_set_by
    assert "eager calls from" in report.table()
    ids = torch.randint(1, 32000, (1, 16), generator=torch.Generator().manual_seed(7))
    expected = logits(eager, ids)
    assert _ran_eagerly(tmp_path, floor, ids, expected, logits)
    assert not _ran_eagerly(tmp_path, floor - 256 * 2**10, ids, expected, logits)


def test_routed_experts_have_an_eager_floor_where_their_eager_code_computes_on_views():
    """Transformers' default experts implementation computes on views of the stacked weights on the CPU;
    ``batched_mm`` gathers a copy of an expert's weights per routed token, which no config bound sees, and
    a GPU's kernels are not measured: those calls are captured."""
    import transformers as tf

    from fxoffload_hf.plan import plan_config

    config = tf.MixtralConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, num_local_experts=4, vocab_size=1000,
    )  # fmt: skip
    report = plan_config(config, cpu_memory="1GiB", seq_len=8)
    assert report.eager_budget is not None and "eager calls from" in report.table()
    on_gpu = plan_config(config, gpu_memory="1GiB", device="cuda", seq_len=8)
    assert on_gpu.eager_budget is None
    config._experts_implementation = "batched_mm"
    report = plan_config(config, cpu_memory="1GiB", seq_len=8)
    assert report.eager_budget is None and "eager calls        not bounded" in report.table()
