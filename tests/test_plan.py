"""plan: a model planned from its config on the meta device, at a cost that does not grow with depth."""

from __future__ import annotations

import functools

import pytest
import transformers as tf

from fxoffload_hf import plan_capture
from fxoffload_hf.plan import plan_config
from fxoffload_hf.plan_capture import capture_on_meta


@pytest.mark.parametrize("layers", [20, 80])
def test_planning_traces_two_layers_whatever_the_depth(layers):
    import transformers as tf

    config = tf.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_hidden_layers=layers,
        vocab_size=1000,
    )
    report = plan_config(config, gpu_memory="64MiB", device="cuda")
    assert (report.blocks_traced, report.blocks_reused) == (2, layers - 2)
    # the copied layers are in the graph the planner cut: every weight is in a piece but the token
    # embeddings, read by rows where they lie
    assert report.error is None and len(report.pieces) > 1
    table = config.vocab_size * config.hidden_size * 4
    assert sum(report.pieces) == report.weight_bytes - table


def _small(config_class, **extra):
    extra = {"num_key_value_heads": 2, **extra}
    return config_class(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, vocab_size=1000, **extra
    )  # fmt: skip


def _moe(config_class, **extra):
    return _small(config_class, moe_intermediate_size=64, num_experts_per_tok=2, **extra)


@pytest.mark.parametrize(
    ("config", "traced", "gpu_memory"),
    [
        (_small(tf.LlamaConfig, num_hidden_layers=12), 2, "4MiB"),
        (_small(tf.MistralConfig, num_hidden_layers=6, sliding_window=16), 2, "4MiB"),
        (
            tf.GPT2Config(n_layer=8, n_head=4, n_embd=128, vocab_size=1000, bos_token_id=0, eos_token_id=0),
            2,
            "4MiB",
        ),
        # dynamo's stamped-out regions trace its layers into twice the ops (and activations) of a plain
        # capture, which is what the engine cuts: two layers deepened match the plain capture
        (
            tf.FalconConfig(hidden_size=128, num_attention_heads=4, num_hidden_layers=5, vocab_size=1000),
            2,
            "4MiB",
        ),
        # layers of several kinds: sliding and full attention by turns, five to one, or alternating with
        # experts; dense layers before experts; linear attention three to one
        (_small(tf.Gemma2Config, num_hidden_layers=6, head_dim=32), 3, "4MiB"),
        (_small(tf.Gemma3TextConfig, num_hidden_layers=14, head_dim=32, sliding_window=16), 6, "4MiB"),
        (_small(tf.GptOssConfig, num_hidden_layers=6, head_dim=32, num_local_experts=4), 3, "4MiB"),
        (
            _moe(
                tf.DeepseekV3Config,
                num_hidden_layers=6,
                first_k_dense_replace=2,
                n_routed_experts=4,
                num_key_value_heads=4,
                n_group=1,
                topk_group=1,
            ),
            3,
            "4MiB",
        ),
        # one kind, but a residual scale derived from the depth (a shallow model's differs)
        (
            tf.MiniCPM3Config(
                hidden_size=128,
                intermediate_size=256,
                num_attention_heads=4,
                num_key_value_heads=4,
                num_hidden_layers=5,
                vocab_size=1000,
                q_lora_rank=32,
                kv_lora_rank=32,
                qk_nope_head_dim=16,
                qk_rope_head_dim=16,
                v_head_dim=16,
            ),
            2,
            "4MiB",
        ),
        # three kinds (compressed, heavily compressed and sparse attention; routed by hashes, then learned)
        pytest.param(
            tf.DeepseekV4Config(
                hidden_size=128,
                num_hidden_layers=7,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=32,
                qk_rope_head_dim=16,
                vocab_size=1000,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=64,
                q_lora_rank=32,
                o_lora_rank=32,
                o_groups=2,
                index_n_heads=4,
                index_head_dim=16,
                index_topk=8,
                sliding_window=16,
            ),
            5,
            "4MiB",
            marks=pytest.mark.slow,
        ),
        # (its linear attention holds 20 MiB of activations at this length)
        (_moe(tf.Qwen3NextConfig, num_hidden_layers=8, head_dim=32, num_experts=4), 4, "40MiB"),
    ],
    ids=[
        "llama",
        "mistral",
        "gpt2",
        "falcon",
        "gemma2",
        "gemma3",
        "gpt-oss",
        "deepseek-v3",
        "minicpm3",
        "deepseek-v4",
        "qwen3-next",
    ],
)
def test_a_plan_from_the_first_layers_equals_the_plan_of_the_whole_capture(
    config, traced, gpu_memory, monkeypatch
):
    """The graph deepened from the first layers captured (each kind of layer at least once after the
    first) is cut into the pieces the deep model's own plain capture (as the engine captures) is cut
    into, with the same floor, activations and arena. (Planned for a GPU: on the CPU, the state of the
    captured graphs sets these tiny models' floors.)"""
    device, budget = "cuda", {"gpu_memory": gpu_memory}
    shallow = plan_config(config, device=device, seq_len=32, **budget)
    layers = config.num_hidden_layers
    assert (shallow.blocks_traced, shallow.blocks_reused) == (traced, layers - traced)
    monkeypatch.setattr(plan_capture, "shallow", lambda *args: None)
    monkeypatch.setattr(
        plan_capture, "capture_on_meta", functools.partial(capture_on_meta, stamp_blocks=False)
    )
    whole = plan_config(config, device=device, seq_len=32, **budget)
    fields = (
        "pieces", "smallest_budget", "floor_set_by", "activation_bytes", "weight_bytes", "arena_bytes",
        "resident_small_bytes",
    )  # fmt: skip
    assert [getattr(shallow, f) for f in fields] == [getattr(whole, f) for f in fields]
    assert len(shallow.pieces) > 2 and shallow.error is None


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


@pytest.mark.usefixtures("counted_graph_state")
def test_a_cpu_floor_counts_generates_two_captured_graphs_a_gpu_floor_does_not(monkeypatch):
    import transformers as tf

    from fxoffload_hf.memory_model import GRAPH_STATE_BYTES_PER_OP

    config = tf.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_hidden_layers=3, vocab_size=1000
    )
    cpu = plan_config(config, device="cpu", seq_len=16, cpu_memory="1GiB")
    gpu = plan_config(config, device="cuda", seq_len=16, gpu_memory="1GiB")
    assert cpu.graph_state_bytes > 0 and cpu.graph_state_bytes % (2 * GRAPH_STATE_BYTES_PER_OP) == 0
    assert "captured graphs" in cpu.floor_set_by and "captured graphs" in cpu.table()
    assert gpu.graph_state_bytes == 0 and "captured graphs" not in gpu.table()
    # given cpu_memory, a GPU plan charges the graphs' state to it: fewer weights come from host RAM
    cpu_memory = cpu.graph_state_bytes + gpu.weight_bytes // 2  # room for half the weights beside them
    hosted = plan_config(config, device="cuda", seq_len=16, gpu_memory="1MiB", cpu_memory=cpu_memory)
    assert hosted.graph_state_bytes == cpu.graph_state_bytes and hosted.smallest_budget == gpu.smallest_budget
    assert "charged to cpu_memory" in hosted.table()
    host_room = cpu_memory - hosted.graph_state_bytes
    streamed = [e for e in hosted.tradeoff if e.from_host + e.from_disk]
    assert streamed and all(e.from_host <= host_room for e in streamed)
    assert any(e.from_host for e in streamed)
    assert any(e.from_disk for e in streamed)
    # the same plan without the count: the floor is lower by the graphs' state, and by what the second
    # graph's capture transient holds beyond the activations (between calls, in their place)
    monkeypatch.setenv("FXOFFLOAD_HF_COUNT_GRAPH_STATE", "0")
    uncounted = plan_config(config, device="cpu", seq_len=16, cpu_memory="1GiB")
    one_graph = cpu.graph_state_bytes // 2  # the transient, about one graph's state
    beyond = cpu.smallest_budget - uncounted.smallest_budget - cpu.graph_state_bytes
    assert one_graph - uncounted.smallest_budget < beyond < one_graph  # activations' room taken by it
    assert "kept while a graph is captured" in cpu.floor_set_by


def test_a_head_converted_before_its_projection_sets_the_floor_by_its_tiles(checkpoint_config):
    # Ergo's head: ``F.linear(x.float(), weight.float())`` of a bf16 weight; its tiles convert their own
    # rows, so neither the head nor its whole fp32 copy sets the floor
    import torch

    config = checkpoint_config("ergo-vocab-heavy")
    config.dtype = torch.bfloat16
    report = plan_config(config, gpu_memory="1GiB", device="cuda", seq_len=32)
    head = 32000 * 256 * 2
    # bf16 weights beside fp32 gates: the cache and the tiles in bf16, as most of the weights are
    from fxoffload_hf.kv_cache import kv_cache_bytes

    assert report.kv_cache_bytes == kv_cache_bytes(config, 1, 32, 2)
    assert "lm_head.weight" in report.floor_set_by and "tiles" in report.floor_set_by
    assert report.smallest_budget < head
    # the whole head converted to fp32 (31 MiB) is not an activation where it streams in tiles
    assert report.tiled_activation_bytes is not None
    assert report.tiled_activation_bytes == report.activation_bytes - 2 * head


def test_a_budget_plans_a_converted_head_in_tiles_as_the_floor_does(checkpoint_config):
    # with a budget, the partition too counts the tiled graph's activations, not the head's fp32 copy
    import torch

    config = checkpoint_config("ergo-vocab-heavy")
    config.dtype = torch.bfloat16
    floor = plan_config(config, device="cpu", seq_len=32).smallest_budget
    report = plan_config(config, cpu_memory=floor + 2**20, device="cpu", seq_len=32)
    assert report.error is None and report.smallest_budget == floor
