"""Shared fixtures: tiny random-init models built from transformers configs."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.set_num_threads(2)


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
    """A tiny random-init model of a real architecture, in eval mode, seeded."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(num_hidden_layers=4, num_attention_heads=4, hidden_size=128, intermediate_size=256)
    common.update(overrides)
    if kind == "mlp":
        return MLP().eval()
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


@pytest.fixture
def tiny():
    return build_model
