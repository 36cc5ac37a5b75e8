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
    report = plan_config(config, gpu_memory="64MiB", device="cuda")
    assert (report.blocks_traced, report.blocks_reused) == (1, layers - 1)
    # the stamped-out blocks are in the graph the planner cut: every weight is in a piece
    assert report.error is None and len(report.pieces) > 1
    assert sum(report.pieces) == report.weight_bytes


def test_the_plan_counts_generates_kv_cache_at_the_length_asked():
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=1000,
    )
    short = plan_config(config, gpu_memory="64MiB", device="cuda", batch=2, seq_len=64)
    long = plan_config(config, gpu_memory="64MiB", device="cuda", batch=2, seq_len=4096)
    # keys and values, 3 layers, 2 sequences, 2 key/value heads of 32, fp32
    assert long.kv_cache_bytes == 2 * 3 * 2 * 2 * 32 * 4096 * 4
    assert short.kv_cache_bytes == long.kv_cache_bytes // 64
    # a decode step at 4,096 positions holds the cache it was passed and the one it builds
    grown = long.smallest_budget - short.smallest_budget
    assert grown >= 2 * long.kv_cache_bytes - (short.activation_bytes + short.kv_cache_bytes)
    assert "KV cache" in long.table() and "KV cache" in long.floor_set_by


def test_on_the_cpu_the_floor_is_set_by_the_smallest_tile_not_the_largest_table():
    """vocab 32,000 against hidden 256: each table takes 31 MiB. On the CPU the output head streams in
    tiles of rows and the embedding is read by rows, so the smallest budget is far below one table, and
    a budget below it is planned; a GPU plan (no tiles there) still needs the table whole."""
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=32000,
    )
    table = 32000 * 256 * 4
    cpu = plan_config(config, cpu_memory=table // 4, device="cpu", seq_len=16)
    assert cpu.smallest_budget < table // 4 and "tiles of rows" in cpu.floor_set_by
    assert cpu.error is None and max(cpu.pieces) < table // 4
    gpu = plan_config(config, gpu_memory=table // 4, device="cuda", seq_len=16)
    assert gpu.smallest_budget > table and gpu.error is not None
