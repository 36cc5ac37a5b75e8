"""plan: a model planned from its config on the meta device, at a cost that does not grow with depth."""

from __future__ import annotations

import pytest

from fxoffload_hf.plan import plan_config


@pytest.mark.parametrize("layers", [20, 80])
def test_planning_traces_one_block_whatever_the_depth(layers):
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_hidden_layers=layers,
        vocab_size=1000,
    )
    report = plan_config(config, gpu_memory="16MiB", device="cuda")
    assert (report.blocks_traced, report.blocks_reused) == (1, layers - 1)
    # the stamped-out blocks are in the graph the planner cut: every weight is in a piece
    assert report.error is None and len(report.pieces) > 1
    assert sum(report.pieces) == report.weight_bytes
