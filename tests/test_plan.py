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
    # the stamped-out blocks are in the graph the planner cut: every weight is in a piece but the token
    # embeddings, read by rows where they lie
    assert report.error is None and len(report.pieces) > 1
    table = config.vocab_size * config.hidden_size * 4
    assert sum(report.pieces) == report.weight_bytes - table


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


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_floor_is_set_by_the_smallest_tile_not_the_largest_table(device):
    """vocab 32,000 against hidden 256: each table takes 31 MiB. The output head streams in tiles of rows
    and the embedding is read by rows (from its mapped file, or on CUDA gathered on the host), so the
    smallest budget is far below one table, and a budget below it is planned. A tile on the CPU is held
    twice (its whole-shaped buffer), on CUDA once."""
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=32000,
    )
    table = 32000 * 256 * 4
    budget = {"cpu_memory" if device == "cpu" else "gpu_memory": table // 4}
    report = plan_config(config, device=device, seq_len=16, **budget)
    assert report.smallest_budget < table // 4 and "tiles of rows" in report.floor_set_by
    assert report.error is None and max(report.pieces) < table // 4
    if device == "cuda":
        cpu = plan_config(config, device="cpu", seq_len=16, cpu_memory=table // 4)
        assert report.smallest_budget < cpu.smallest_budget
