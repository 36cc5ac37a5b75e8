"""Random-init checkpoints of real architectures, sized on request, cached on disk (for demo and bench)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fxoffload_hf.align import align_shards_in_place

ARCHES = ("llama", "qwen2", "mistral")


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fxoffload_hf"


def demo_config(arch: str, size_gb: float):
    """A config of ``arch`` whose fp32 weights take about ``size_gb`` GB; no single weight over ~70 MB."""
    import transformers as tf

    hidden, intermediate, vocab = (1536, 4096, 8192) if size_gb >= 0.5 else (256, 704, 2048)
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * intermediate)
    embeddings = 2 * 4 * vocab * hidden
    layers = max(1, round((size_gb * 1e9 - embeddings) / per_layer))
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    classes = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}
    if arch not in classes:
        raise ValueError(f"arch: {arch!r} is not one of {ARCHES}")
    return classes[arch](**common)


def ensure_checkpoint(arch: str = "llama", size_gb: float = 1.0, folder: Path | None = None) -> Path:
    """Build (once) and return a sharded safetensors checkpoint with random weights."""
    folder = folder or cache_root() / f"demo-{arch}-{size_gb:g}gb"
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    config = demo_config(arch, size_gb)
    print(
        f"Building a random-init {arch} checkpoint of about {size_gb:g} GB in {folder} (once) ...", flush=True
    )
    save_random_checkpoint(config, folder)
    return folder


def save_random_checkpoint(
    config: Any,
    folder: Path,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    shard_size: str = "200MB",
    extra_files: dict[str, str] | None = None,
    replace: bool = False,
) -> dict[str, int]:
    """Save a seeded random-init causal LM of ``config`` as safetensors shards (and ``extra_files``).

    It is written beside ``folder`` and renamed into place, so an interrupted build never passes for a
    checkpoint; an existing ``folder`` is deleted first only with ``replace``. Returns its parameter count
    and bytes.
    """
    import transformers as tf

    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=shard_size)
    # used in place by CPU runs whatever the header's length (``align``); a user's own checkpoint may not be
    align_shards_in_place(partial)
    for name, text in (extra_files or {}).items():
        (partial / name).write_text(text)
    if replace:
        shutil.rmtree(folder, ignore_errors=True)
    os.replace(partial, folder)
    params = list(model.parameters())
    return {
        "params": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
    }


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))
