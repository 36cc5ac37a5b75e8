"""Modules that read a child's weight without calling the child (``direct_reads``): their eager calls are
lent the child's weights too, so an offloaded model wide enough for those weights to stream (not kept
resident as small tensors) still gives eager's output. Before, such a read saw the child's ghost: NaN."""

from __future__ import annotations

import torch
import transformers
from torch import nn

import fxoffload_hf
from fxoffload_hf.direct_reads import children_read_directly


class ReadsTable(nn.Module):
    """Reads ``table``'s weight directly (as positional biases are read) and calls ``projection``."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.table = nn.Embedding(width, width)
        self.projection = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x) + x @ self.table.weight


class ReadsDtype(nn.Module):
    """Reads only what ``table``'s weight is, not its values, and calls ``projection``."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.table = nn.Embedding(width, width)
        self.projection = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(x.to(self.table.weight.dtype))


def _mamba(**sizes: int) -> transformers.MambaConfig:
    # hidden 512: ``dt_proj`` (1024 x 32) and, with a 16-wide kernel, ``conv1d`` (1024 x 1 x 16) are 64 KiB
    # or more, so they stream instead of staying resident
    return transformers.MambaConfig(
        vocab_size=1000, hidden_size=512, num_hidden_layers=2, state_size=16, conv_kernel=16, **sizes
    )


def test_children_read_without_a_call_are_found():
    mixer = transformers.MambaForCausalLM(_mamba()).backbone.layers[0].mixer
    # declared by Transformers (``force_accelerate_hooks``): ``conv1d`` and ``dt_proj``; ``x_proj`` and
    # ``out_proj`` are called, and read in the training kernel's path: ``x_proj`` is small (256 KiB), lent
    # too, ``out_proj`` (2 MiB) is not (``in_proj`` is only called)
    assert children_read_directly(mixer) == [mixer.conv1d, mixer.x_proj, mixer.dt_proj]
    reads = ReadsTable()
    assert children_read_directly(reads) == [reads.table]  # read as ``self.table.weight``; projection called
    assert children_read_directly(ReadsDtype()) == []  # a ghost's dtype is its weight's: nothing to lend
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        )
    )
    assert not any(children_read_directly(module) for module in llama.modules())


def test_mamba_wide_enough_to_stream_its_mixers_children_equals_eager(
    tmp_path, counted_graph_state, default_capture
):
    """As by default (deferred capture, graphs' state counted): the first calls run eagerly."""
    torch.manual_seed(0)
    transformers.MambaForCausalLM(_mamba()).save_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        want, want_tokens = reference(ids).logits, reference.generate(ids, **greedy)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=weights * 3 // 4, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    mixer = model.backbone.layers[0].mixer
    assert {"backbone.layers.0.mixer.dt_proj.weight", "backbone.layers.0.mixer.conv1d.weight"} <= set(
        engine.store.records
    )  # offloaded: ghosts until lent
    with torch.no_grad():
        got = model(ids).logits
        assert engine.runners == [] and engine.stats.eager_calls == 1  # eager
        tokens = model.generate(ids, **greedy)
    assert torch.equal(got, want) and torch.equal(tokens, want_tokens)
    assert torch.isnan(mixer.dt_proj.weight).all()  # given back after the calls
    fxoffload_hf.restore(model)


def _recurrent_gemma() -> transformers.RecurrentGemmaConfig:
    # a 16-wide convolution over 1,024 channels: ``conv_1d``'s weight is 64 KiB, so it streams
    return transformers.RecurrentGemmaConfig(
        vocab_size=1000, hidden_size=256, lru_width=1024, conv1d_width=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, intermediate_size=512,
        block_types=["recurrent", "attention"], attention_window_size=16,
    )  # fmt: skip


def test_a_small_child_called_on_a_prompt_and_read_at_each_decode_step_is_lent_for_both(
    tmp_path, default_capture
):
    """RecurrentGemma's recurrent block calls ``conv_1d`` on a prompt and reads its weight in each decode
    step: a child called and read, lent with the block where what is read is small. Before, the decode
    steps read its ghost (NaN) and the tokens went wrong."""
    torch.manual_seed(0)
    transformers.RecurrentGemmaForCausalLM(_recurrent_gemma()).save_pretrained(tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    ids = torch.randint(1, 1000, (2, 7), generator=torch.Generator().manual_seed(1))
    greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = reference.generate(ids, **greedy)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=weights // 2, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    assert "model.layers.0.temporal_block.conv_1d.weight" in engine.store.records  # offloaded
    with torch.no_grad():
        got = model.generate(ids, **greedy)
    assert engine.runners == [] and engine.stats.eager_calls == 4  # eager: the prefill and three steps
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
    block = model.model.layers[0].temporal_block
    assert children_read_directly(block) == [block.conv_1d]
    fxoffload_hf.restore(model)


def test_a_module_reading_a_childs_weight_equals_eager_captured_and_called_directly():
    """Captured, the engine feeds the child's weight to the graph; called directly (outside the captured
    entry, so eagerly), the module is lent it."""
    torch.manual_seed(0)
    model = nn.Sequential(ReadsTable(), nn.Tanh(), ReadsTable()).eval()
    x = torch.randn(3, 128)
    with torch.no_grad():
        want, want_first = model(x), model[0](x)
    fxoffload_hf.offload(model, cpu_memory="64MiB", device="cpu")
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(model[0](x), want_first)
    assert torch.isnan(model[0].table.weight).all()  # a ghost again: lent for the call only
    fxoffload_hf.restore(model)
