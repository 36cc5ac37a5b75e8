"""Shared fixtures: tiny random-init models and checkpoints built from transformers configs, and the
checks several test modules make of an offloaded model.

Test modules take these helpers as fixtures (``build_model``, ``example_input``, ``weight_bytes``,
``save_checkpoint``, ``llama_master``, ``llama_ckpt``, ``logits``, ``snapshot_params``,
``assert_not_offloaded``, ...), never by importing this module.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxoffload_hf
from fxoffload_hf.align import align_shards_in_place
from fxoffload_hf.progress import logger as progress_logger

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# the suite tests the captured, streamed path from the first call (child processes too), whatever the
# caller's environment; the default, deferred capture, is tested where a test asks for it
# (``tests/test_deferred_capture.py``, with ``default_capture``)
os.environ["FXOFFLOAD_HF_CAPTURE"] = "first-call"
# its budgets force many pieces and every tier on tiny models, below what dynamo's state of their graphs
# takes: that state is counted where a test asks for it (``counted_graph_state``)
os.environ["FXOFFLOAD_HF_COUNT_GRAPH_STATE"] = "0"
# the compile cache is tested where a test asks for it (``tests/test_compile_cache.py``): other tests
# capture as a first process does, and write nothing outside their temporary folders
os.environ.setdefault("FXOFFLOAD_HF_COMPILE_CACHE", "off")
# ``make test`` runs the suite in several workers (pytest-xdist): the cores are shared among them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, 2 // _WORKERS))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After each test, what outlives it (the modules dynamo, inductor and transformers imported, session
    fixtures) is frozen out of the collector's view: each capture ends with a full collection
    (``entries``), which would otherwise walk that heap again, a third of a second a time here."""
    yield
    gc.collect()
    gc.freeze()


class MLP(nn.Module):
    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x))
        return self.head(x)


def build_model(kind: str, **overrides) -> nn.Module:
    """A tiny random-init model of a real architecture, in eval mode, seeded.

    ``overrides`` change the transformers config; for ``"mlp"`` they are ``width`` and ``depth``.
    """
    import transformers as tf

    torch.manual_seed(0)
    if kind == "mlp":
        return MLP(**overrides).eval()
    common = dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=128, intermediate_size=256)
    common.update(overrides)
    if kind == "llama":
        cfg = tf.LlamaConfig(vocab_size=1000, num_key_value_heads=2, **common)
        return tf.LlamaForCausalLM(cfg).eval()
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=1000,
            n_layer=common["num_hidden_layers"],
            n_head=4,
            n_embd=common["hidden_size"],
            n_positions=256,
        )
        return tf.GPT2LMHeadModel(cfg).eval()
    if kind == "bert":
        cfg = tf.BertConfig(vocab_size=1000, max_position_embeddings=256, **common)
        return tf.BertModel(cfg).eval()
    raise ValueError(kind)


def example_input(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return torch.randn(4, 256, generator=gen)
    return torch.randint(0, 1000, (2, 12), generator=gen)


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_config(arch: str):
    """The transformers config of the tiny checkpoints ``save_checkpoint`` writes (three layers)."""
    import transformers as tf

    small = dict(
        num_hidden_layers=3, num_attention_heads=4, hidden_size=128, intermediate_size=256, vocab_size=1000
    )
    if arch == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **small)
    if arch == "llama-vocab-heavy":  # each embedding table 31 MiB, 4.5x the rest of the model
        return tf.LlamaConfig(
            vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
    if arch == "gpt2-vocab-heavy":  # its output head tied to the embedding table (31 MiB)
        return tf.GPT2Config(n_layer=2, n_head=4, n_embd=256, vocab_size=32000)
    if arch == "gemma2-vocab-heavy":  # tied too, its table read by a scaled embedding's own forward
        return tf.Gemma2Config(
            vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        )  # fmt: skip
    if arch == "ergo-vocab-heavy":  # its head computes F.linear(x.float(), weight.float())
        return tf.ErgoConfig(
            vocab_size=32000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, first_dense_intermediate_size=512, moe_intermediate_size=128,
            shared_intermediate_size=256, num_experts=4, num_experts_per_tok=2, sliding_window=16,
            global_attention_every_n_layers=2,
        )  # fmt: skip
    if arch == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, **small)
    if arch == "mistral":
        return tf.MistralConfig(num_key_value_heads=2, **small)
    if arch == "mixtral":
        return tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small)
    # mixtures of experts whose stacked weights are each about a third of the model (``expert_tiles``)
    experts = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    if arch == "mixtral-8-experts":
        return tf.MixtralConfig(
            hidden_size=128, intermediate_size=512, num_local_experts=8, num_experts_per_tok=2, **experts
        )
    if arch == "qwen3_moe":  # many experts, four per token
        return tf.Qwen3MoeConfig(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=256, num_experts=16,
            num_experts_per_tok=4, **experts,
        )  # fmt: skip
    if arch == "gpt_oss":  # stacked weights stored transposed (no transpose in the graph), with biases
        return tf.GptOssConfig(hidden_size=128, intermediate_size=256, num_local_experts=8, **experts)
    if arch in ("deepseek_v3", "deepseek_v32"):  # latent attention over routed experts; an indexer too
        indexer = (
            {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 4} if arch == "deepseek_v32" else {}
        )
        config_class = tf.DeepseekV32Config if indexer else tf.DeepseekV3Config
        return config_class(
            hidden_size=128, intermediate_size=256, moe_intermediate_size=64, kv_lora_rank=32,
            q_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
            **{**experts, "num_key_value_heads": 4}, **indexer,
        )  # fmt: skip
    # Mamba-2 hybrids: shared attention blocks at Zamba 2's hybrid layers; Mamba-2 beside routed experts
    mamba2 = {
        "hidden_size": 64, "vocab_size": 1000, "intermediate_size": 128, "num_attention_heads": 4,
        "mamba_d_state": 8, "mamba_expand": 2, "pad_token_id": 0,
    }  # fmt: skip
    if arch == "zamba2":
        return tf.Zamba2Config(
            **mamba2, num_hidden_layers=4, num_key_value_heads=4, n_mamba_heads=8, mamba_headdim=16,
            mamba_ngroups=1, chunk_size=16, layers_block_type=["mamba", "hybrid"] * 2,
        )  # fmt: skip
    if arch == "zamba":  # Mamba layers of two heads that scan one after the other, shared attention blocks
        return tf.ZambaConfig(
            hidden_size=128, num_attention_heads=4, num_key_value_heads=4, intermediate_size=256, vocab_size=1000,
            num_hidden_layers=4, n_mamba_heads=2, layers_block_type=["mamba", "hybrid"] * 2,
        )  # fmt: skip
    if arch == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(
            **mamba2, num_hidden_layers=2, num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=16,
            mamba_n_groups=1, mamba_chunk_size=16, layer_types=["mamba", "attention"], num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=64,
        )  # fmt: skip
    # LFM2's gated short convolutions beside attention (LFM3: and sliding windows)
    if arch in ("lfm2", "lfm3"):
        kinds = ["conv", "full_attention", "conv" if arch == "lfm2" else "sliding_attention"]
        config_class = tf.Lfm2Config if arch == "lfm2" else tf.Lfm3Config
        return config_class(
            hidden_size=64, vocab_size=1000, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, layer_types=kinds, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            **({"sliding_window": 4} if arch == "lfm3" else {}),
        )  # fmt: skip
    # Kimi's delta attention beside latent attention and routed experts: the coverage sweep's tiny configs
    if arch in ("kimi_linear", "bailing_hybrid", "olmo_hybrid"):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
        from harness.shrink import shrink_config

        return shrink_config(tf.CONFIG_MAPPING[arch]())
    if arch == "minimax":  # Lightning attention in blocks of 16 positions beside attention, routed experts
        return tf.MiniMaxConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=1000, num_local_experts=4, num_experts_per_tok=2,
            block_size=16, layer_types=["linear_attention", "full_attention"],
        )  # fmt: skip
    if arch == "xlstm":  # mLSTM layers only, their states in xLSTM's own cache
        return tf.xLSTMConfig(
            vocab_size=1000,
            hidden_size=128,
            embedding_dim=128,
            num_heads=4,
            num_hidden_layers=2,
            num_blocks=2,
        )
    if arch in ("inkling2", "inkling2_loop"):  # attention and dynamic short convolutions, routed experts
        return tf.CONFIG_MAPPING[f"{arch}_text"](
            vocab_size=1000, unpadded_vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, head_dim=32, swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=32,
            moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
            layer_types=["hybrid_sliding", "hybrid"], eos_token_id=999,
        )  # fmt: skip
    if arch == "inkling":  # attention and short convolutions of its own in every layer, routed experts
        return tf.CONFIG_MAPPING["inkling_text"](
            vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, swa_num_attention_heads=4, swa_num_key_value_heads=1, swa_head_dim=32, intermediate_size=256,
            moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["sparse", "sparse"],
        )  # fmt: skip
    if arch == "zaya":  # attention and a convolution of its own in every layer, routed experts
        return tf.ZayaConfig(
            vocab_size=1000, hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, moe_intermediate_size=128, num_experts=4, layer_types=["hybrid"] * 3,
        )  # fmt: skip
    if arch == "recurrent_gemma":  # RG-LRU recurrences, then local attention of two key heads of 16
        return tf.RecurrentGemmaConfig(
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
            intermediate_size=128, vocab_size=1000, lru_width=64, attention_window_size=16,
            block_types=["recurrent", "attention"],
        )  # fmt: skip
    if arch == "opt":
        return tf.OPTConfig(
            num_hidden_layers=3, num_attention_heads=4, hidden_size=128, ffn_dim=256, vocab_size=1000,
            word_embed_proj_dim=128,
        )  # fmt: skip
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**small)
    if arch == "gpt2":
        return tf.GPT2Config(n_layer=3, n_head=4, n_embd=128, vocab_size=1000)
    if arch == "bert":
        return tf.BertConfig(**small)
    if arch == "t5":
        return tf.T5Config(
            vocab_size=1000,
            d_model=128,
            d_ff=256,
            num_layers=2,
            num_heads=4,
            d_kv=32,
            decoder_start_token_id=0,
        )
    raise ValueError(arch)


def save_checkpoint(arch: str, folder: Path) -> nn.Module:
    """Save a seeded tiny ``arch`` model as a sharded safetensors checkpoint; return it (eval mode)."""
    import transformers as tf

    torch.manual_seed(0)
    config = checkpoint_config(arch)
    if arch == "bert":
        model = tf.BertModel(config)
    elif arch == "t5":
        model = tf.T5ForConditionalGeneration(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    model.eval().save_pretrained(folder, max_shard_size="300KB")
    # tensors where ops compute with mapped pages, whatever the header's length in this environment;
    # the other alignment has a test of its own
    align_shards_in_place(folder)
    return model


def causal_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's logits for ``ids``, computed without autograd."""
    with torch.no_grad():
        return model(ids).logits


def snapshot_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, torch.Tensor]]:
    """Each parameter of ``model`` by name: the object itself and a copy of its values."""
    return {n: (p, p.detach().clone()) for n, p in model.named_parameters()}


def assert_not_offloaded(model: nn.Module, before: dict[str, tuple[nn.Parameter, torch.Tensor]]) -> None:
    """``model`` is not offloaded (not even half) and holds the parameters ``before`` names, unchanged."""
    try:
        fxoffload_hf.engine_of(model)
    except ValueError:
        pass  # the public answer for a model that is not offloaded
    else:
        pytest.fail("the model was left half-offloaded")
    for name, param in model.named_parameters():
        original, values = before[name]
        assert param is original, f"{name} was replaced"
        assert torch.equal(param, values), f"{name} changed"


_PASS_RE = re.compile(r"pass (gpu_memory|cpu_memory)=(\d+)")


def named_budget(exc: BaseException) -> int:
    """The N of ``pass gpu_memory=N`` (or ``cpu_memory``) in a refusal (dynamo wraps refusals raised at
    the first call)."""
    inner = getattr(exc, "inner_exception", None) or exc
    match = _PASS_RE.search(str(inner))
    assert match is not None, f"the refusal does not name a budget that works: {inner}"
    return int(match.group(2))


# -- fixtures ---------------------------------------------------------------------------------------
# Each helper fixture hands out the function above (session scope: module- and session-scoped fixtures
# can use them too). The fixtures are registered under the helpers' names; the module attributes of
# those names stay the plain functions.


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def report_lines():
    """The lines fxoffload reports (``progress``) while the test runs, as a list of messages."""
    lines = _Lines()
    level = progress_logger.level
    progress_logger.addHandler(lines)
    progress_logger.setLevel(logging.INFO)
    try:
        yield lines.lines
    finally:
        progress_logger.removeHandler(lines)
        progress_logger.setLevel(level)


@pytest.fixture(name="build_model", scope="session")
def build_model_fixture() -> Callable[..., nn.Module]:
    """``build_model(kind, **overrides)``: a seeded tiny random-init model, in eval mode."""
    return build_model


@pytest.fixture(name="example_input", scope="session")
def example_input_fixture() -> Callable[[str], torch.Tensor]:
    """``example_input(kind)``: a seeded input batch for ``build_model(kind)``."""
    return example_input


@pytest.fixture(name="weight_bytes", scope="session")
def weight_bytes_fixture() -> Callable[[nn.Module], int]:
    """``weight_bytes(model)``: the bytes of a model's parameters."""
    return weight_bytes


@pytest.fixture(name="checkpoint_config", scope="session")
def checkpoint_config_fixture() -> Callable[[str], object]:
    """``checkpoint_config(arch)``: the config of the checkpoints ``save_checkpoint`` writes."""
    return checkpoint_config


@pytest.fixture(name="save_checkpoint", scope="session")
def save_checkpoint_fixture() -> Callable[[str, Path], nn.Module]:
    """``save_checkpoint(arch, folder)``: save a sharded tiny checkpoint and return its eager model."""
    return save_checkpoint


@pytest.fixture(name="logits", scope="session")
def logits_fixture() -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """``logits(model, ids)``: a causal LM's logits for ``ids``, computed without autograd."""
    return causal_logits


@pytest.fixture(name="snapshot_params", scope="session")
def snapshot_params_fixture() -> Callable[[nn.Module], dict[str, tuple[nn.Parameter, torch.Tensor]]]:
    """``snapshot_params(model)``: each parameter by name, the object and a copy of its values."""
    return snapshot_params


@pytest.fixture(name="assert_not_offloaded", scope="session")
def assert_not_offloaded_fixture() -> Callable[[nn.Module, dict], None]:
    """``assert_not_offloaded(model, before)``: not offloaded, the parameters of ``before`` unchanged."""
    return assert_not_offloaded


@pytest.fixture(name="named_budget", scope="session")
def named_budget_fixture() -> Callable[[BaseException], int]:
    return named_budget


@pytest.fixture(scope="session")
def deferred_refusal():
    """``deferred_refusal(folder, budget, ids, match)``: the ``BudgetTooSmallError`` (matching ``match``)
    that a causal LM from ``folder``, offloaded at ``budget`` with deferred capture, raises for ``ids``;
    the model restored afterwards."""
    from fxoffload_hf.memory_model import BudgetTooSmallError

    def refusal(folder: Path, budget, ids: torch.Tensor, match: str) -> BudgetTooSmallError:
        model = fxoffload_hf.from_pretrained(folder, cpu_memory=budget, device="cpu", capture="deferred")
        try:
            with pytest.raises(BudgetTooSmallError, match=match) as refused:
                causal_logits(model, ids)
        finally:
            fxoffload_hf.restore(model)
        return refused.value

    return refusal


@pytest.fixture
def deferred_run():
    """``deferred_run(folder, budget, ids)``: the logits a causal LM from ``folder``, offloaded at ``budget``
    with deferred capture, gives for ``ids``, and the eager calls its engine ran; the model restored
    afterwards."""

    def run(folder: Path, budget, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        model = fxoffload_hf.from_pretrained(folder, cpu_memory=budget, device="cpu", capture="deferred")
        try:
            got = causal_logits(model, ids)
            return got, fxoffload_hf.engine_of(model).stats.eager_calls
        finally:
            fxoffload_hf.restore(model)

    return run


@pytest.fixture(autouse=True)
def capture_not_chosen_by_the_clock(monkeypatch) -> None:
    """Deferred capture ends when eager calls have taken about what capture is estimated to cost: a
    matter of this machine's speed and load at the time. Tests choose it (setting
    ``_CAPTURE_SECONDS_PER_MODULE_CALL`` where they test it); elsewhere eager calls never end deferring
    by their time, so a loaded machine does not change what a test checks."""
    import fxoffload_hf.deferral

    monkeypatch.setattr(fxoffload_hf.deferral, "_CAPTURE_SECONDS_PER_MODULE_CALL", float("inf"))


@pytest.fixture
def eager_calls_bounded(monkeypatch) -> None:
    """Deferred capture runs a toy model's calls eagerly: their bound is taken as nothing beside their
    weights (a model without a Transformers config has none, and would be captured)."""
    import fxoffload_hf.entries

    monkeypatch.setattr(fxoffload_hf.entries, "eager_call_bytes", lambda *args, **kwargs: 0)


@pytest.fixture
def llama_layers_break_graphs(monkeypatch) -> None:
    """A graph break after each Llama decoder layer: a call is captured as several graphs (a no-op in
    eager code, so an eager model gives the same output)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer as layer

    forward = layer.forward

    def broken(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        torch._dynamo.graph_break()
        return out

    monkeypatch.setattr(layer, "forward", broken)


@pytest.fixture
def second_graph_refused(monkeypatch) -> list[int]:
    """From now on an engine refuses the second graph dynamo hands it, as a budget would (a
    ``BudgetTooSmallError``); the graphs handed, by their node counts."""
    from fxoffload_hf.engine import Engine
    from fxoffload_hf.memory_model import BudgetTooSmallError

    graphs: list[int] = []
    backend = Engine.__call__

    def refusing(self, gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        if len(graphs) == 2:
            raise BudgetTooSmallError("the second graph does not fit (a test's refusal)", smallest_budget=1)
        return backend(self, gm, example_inputs)

    monkeypatch.setattr(Engine, "__call__", refusing)
    return graphs


@pytest.fixture
def backend_calls(monkeypatch) -> list[int]:
    """The graphs dynamo hands an engine from now on, by their node counts: a spy on ``Engine.__call__``."""
    from fxoffload_hf.engine import Engine

    calls: list[int] = []
    backend = Engine.__call__

    def spy(self, gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return backend(self, gm, example_inputs)

    monkeypatch.setattr(Engine, "__call__", spy)
    return calls


@pytest.fixture
def three_weights(tmp_path, place_data_at):
    """A safetensors file of three small weights (fp32 "a" and "b", fp16 "h"), its data placed to be mapped
    in place (``mapped_io.can_map``): ``(tensors, slices)``."""
    from safetensors.torch import save_file

    from fxoffload_hf.safetensors_io import read_header

    tensors = {"a": torch.randn(64, 32), "b": torch.randn(128), "h": torch.randn(16, 16).half()}
    save_file(tensors, tmp_path / "w.safetensors")
    place_data_at(tmp_path, 0)
    return tensors, read_header(tmp_path / "w.safetensors")


@pytest.fixture
def tile_holds(monkeypatch) -> list[str]:
    """The ways tiles came into their whole-shaped buffers, in order: "hold" (copied) or "hold_file"
    (their file's pages mapped, no copy); a spy on ``tile_buffer.WholeShapedBuffer``."""
    from fxoffload_hf import tile_buffer

    held: list[str] = []
    for way in ("hold", "hold_file"):
        original = getattr(tile_buffer.WholeShapedBuffer, way)

        def spy(self, *args, _way=way, _original=original):
            held.append(_way)
            return _original(self, *args)

        monkeypatch.setattr(tile_buffer.WholeShapedBuffer, way, spy)
    return held


@pytest.fixture(scope="session")
def prompt_ids() -> torch.Tensor:
    """A seeded (1, 10) batch of token ids for the tiny causal LMs (a vocabulary of 1000)."""
    return torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def mlp(build_model) -> Callable[..., nn.Module]:
    """``mlp(width=256, depth=6)``: a seeded MLP in eval mode."""

    def make(width: int = 256, depth: int = 6) -> nn.Module:
        return build_model("mlp", width=width, depth=depth)

    return make


@pytest.fixture
def mlp_case(mlp) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The default MLP, a batch of input and the MLP's output for it (before any offload)."""
    model = mlp()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    return model, x, expected


@pytest.fixture
def small_llama(build_model, example_input) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A two-layer tiny Llama, its example input and its logits for it (before any offload)."""
    model = build_model("llama", num_hidden_layers=2)
    x = example_input("llama")
    return model, x, causal_logits(model, x)


@pytest.fixture(scope="session")
def llama_master(tmp_path_factory) -> tuple[Path, nn.Module]:
    """A sharded tiny Llama checkpoint, saved once per session, and its eager model.

    Shared: never write to the folder nor change the model; take ``llama_ckpt`` (a private copy) or copy it.
    """
    folder = tmp_path_factory.mktemp("llama-master")
    return folder, save_checkpoint("llama", folder)


@pytest.fixture
def llama_ckpt(llama_master, tmp_path) -> tuple[Path, nn.Module]:
    """A private copy of ``llama_master``'s checkpoint (a test may damage it) and the eager model."""
    master, eager = llama_master
    folder = tmp_path / "ckpt"
    shutil.copytree(master, folder)
    return folder, eager


@pytest.fixture
def tiny():
    return build_model


@pytest.fixture(name="place_data_at", scope="session")
def place_data_at_fixture() -> Callable[[Path, int], None]:
    """``place_data_at(folder, remainder)``: rewrite the folder's shards so that their data sections start
    at ``remainder`` modulo 16 bytes (ops compute with mapped pages only at 0)."""
    return lambda folder, remainder: align_shards_in_place(folder, data_start=remainder)


@pytest.fixture
def counted_graph_state(monkeypatch) -> None:
    """Captured graphs' state counted in CPU budgets, as by default (the suite otherwise leaves it out)."""
    monkeypatch.delenv("FXOFFLOAD_HF_COUNT_GRAPH_STATE")


@pytest.fixture
def default_capture(monkeypatch) -> None:
    """The library's own default capture mode for this test (the suite otherwise captures at the first call)."""
    monkeypatch.delenv("FXOFFLOAD_HF_CAPTURE")


class ConvertedHead(nn.Module):
    """Ergo's output head: its weight converted to the input's dtype, then both to fp32."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 16, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.to(x.dtype).float())


@pytest.fixture(name="converted_head")
def converted_head_fixture() -> type[ConvertedHead]:
    return ConvertedHead


@pytest.fixture
def captured_graph() -> Callable[[nn.Module, torch.Tensor], tuple[Any, list[Any]]]:
    """Capture ``module(x)`` as one graph with dynamo (no engine): the graph and its weight placeholders."""

    def capture(module: nn.Module, x: torch.Tensor) -> tuple[Any, list[Any]]:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        try:
            torch.compile(module, backend=backend, fullgraph=True)(x)
        finally:
            torch._dynamo.reset()
        (gm,) = graphs
        return gm, [n for n in gm.graph.nodes if n.op == "placeholder" and "weight" in n.name]

    return capture
