"""The benchmarks' model: a Llama config of a given size, built once (seeded), its facts, and loading it.

The checkpoint is written by ``fxoffload_hf.demo.save_random_checkpoint`` (the demo's builder) in a child;
the facts come from the safetensors headers alone, so a parent reads them without torch.
"""

from __future__ import annotations

import importlib
import json
import struct
from pathlib import Path
from typing import Any

SEED = 0
META = "bench-meta.json"  # seed and config of a built model: a cached model is used only when they match
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# the default model: untied embeddings and head of 16000 x 1024 fp32 (65.5 MB each) are the largest weights
VOCAB, HIDDEN, INTERMEDIATE, HEADS = 16000, 1024, 2816, 16


def llama_config(
    size_gb: float,
    *,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    intermediate: int = INTERMEDIATE,
    heads: int = HEADS,
    dtype: str = "float32",
    min_layers: int = 1,
) -> dict[str, Any]:
    """A LlamaConfig (as keyword arguments) of about ``size_gb`` GB of ``dtype`` weights."""
    item = DTYPE_BYTES[dtype]
    head_bytes = 2 * vocab * hidden * item
    layer_bytes = (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) * item
    layers = max(min_layers, round((size_gb * 1e9 - head_bytes) / layer_bytes))
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "dtype": dtype,
    }


def kv_cache_bytes(config: dict[str, Any], batch: int, positions: int) -> int:
    """Bytes of the key/value cache of ``config`` (a :func:`llama_config`) holding ``positions`` tokens for
    each of ``batch`` sequences: memory any way of running the model needs beside its weights."""
    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[config["dtype"]]
    return per_token * batch * positions


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's shards, in order."""
    return sorted(model_dir.glob("*.safetensors"))


def checkpoint_facts(model_dir: Path) -> dict[str, Any]:
    """Shard count, total bytes and largest tensor, from the safetensors headers alone."""
    largest, tensors = 0, 0
    files = safetensors_files(model_dir)
    for file in files:
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                start, end = entry["data_offsets"]
                largest = max(largest, end - start)
                tensors += 1
    return {
        "dir": str(model_dir),
        "shards": len(files),
        "tensors": tensors,
        "checkpoint_bytes": sum(f.stat().st_size for f in files),
        "largest_tensor_bytes": largest,
    }


def model_is_cached(model_dir: Path, config: dict[str, Any], seed: int = SEED) -> bool:
    """Whether ``model_dir`` holds a model built from ``config`` and ``seed``."""
    meta = model_dir / META
    if not meta.exists() or not safetensors_files(model_dir):
        return False
    return json.loads(meta.read_text()) == {"seed": seed, "config": config}


def build(
    model_dir: Path, config: dict[str, Any], seed: int = SEED, device: str = "cpu", shard_size: str = "200MB"
) -> dict[str, int]:
    """Random-init (seeded) Llama of ``config`` saved in shards, replacing ``model_dir``; its parameter
    count and bytes."""
    import torch
    import transformers

    from fxoffload_hf.demo import save_random_checkpoint

    return save_random_checkpoint(
        transformers.LlamaConfig(**config),
        model_dir,
        seed=seed,
        device=device,
        dtype=getattr(torch, config["dtype"]),
        shard_size=shard_size,
        extra_files={META: json.dumps({"seed": seed, "config": config})},
        replace=True,
    )


def import_model_code(model_dir: Path) -> None:
    """Import the model's modeling and generation code: code pages and module objects (about 90 MiB for
    Llama) are the same for every run and no part of the model's memory."""
    import transformers.generation  # noqa: F401

    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def load_model(mode: str, model_dir: Path, budget: int, offload_dir: Path) -> Any:
    """``model_dir`` on the CPU: all in RAM (eager), or within ``budget`` by fxoffload_hf or accelerate."""
    import transformers

    if mode == "eager":
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    if mode in ("fxoffload", "fxoffload-deferred"):
        import fxoffload_hf

        # "fxoffload": the streamed schedule, captured at the warm-up; "fxoffload-deferred": the default,
        # whose short jobs run as eager calls within the budget
        capture = "first-call" if mode == "fxoffload" else "deferred"
        return fxoffload_hf.from_pretrained(
            model_dir,
            offload="fx",
            cpu_memory=budget,
            device="cpu",
            capture=capture,
            offload_folder=offload_dir,
        )
    if mode == "accelerate":
        return transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(offload_dir)
        )
    raise ValueError(f"unknown mode {mode!r}")
