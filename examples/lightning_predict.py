"""Predict with a LightningModule whose Hugging Face model is offloaded by fxoffload_hf.

By default a tiny random-init Llama is built, so the example runs anywhere in seconds:

    python examples/lightning_predict.py
    python examples/lightning_predict.py --precision bf16-true --gpu-memory 600KB
    python examples/lightning_predict.py --cpu-memory 1MB --batches-per-block 4  # 4 batches per weight read
    python examples/lightning_predict.py --devices 2 --strategy ddp     # two processes on the CPU
    python examples/lightning_predict.py --model path/to/checkpoint --accelerator gpu --gpu-memory 8GiB

``--save-dir`` writes each rank's input ids, sample indices and logits to ``predictions-rank<N>.pt`` and
its offload statistics to ``stats-rank<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import torch
import transformers
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fxoffload_hf.callbacks import FxOffloadCallback


class IndexedIds(Dataset):
    """Random token ids, each with its index so that predictions from several ranks can be merged."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.ids[index]


class CausalLMPredictor(pl.LightningModule):
    """Next-token logits of a causal language model held in ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        index, ids = batch
        logits = self.model(input_ids=ids).logits
        return {"index": index, "ids": ids, "logits": logits[:, -1]}


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.model is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="a Hugging Face model name or folder (default: a tiny random Llama)")
    parser.add_argument("--layers", type=int, default=4, help="layers of the tiny random Llama")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory", help="budget on the compute device (default: half of the weights)")
    parser.add_argument("--cpu-memory", help="host RAM for weights; the rest goes to --offload-folder")
    parser.add_argument("--offload-folder")
    parser.add_argument("--policy", default="auto", choices=("auto", "sequential"))
    parser.add_argument(
        "--batches-per-block",
        type=int,
        default=1,
        help="predict this many batches as one block: each weight streamed once for all of them",
    )
    parser.add_argument("--no-offload", action="store_true", help="run without the callback, for comparison")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--save-dir", type=Path, help="write each rank's predictions and stats here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = build_model(args)
    callbacks: list[pl.Callback] = []
    callback = None
    if not args.no_offload:
        gpu_memory = args.gpu_memory or int(weight_bytes(model) * 0.5)
        callback = FxOffloadCallback(
            gpu_memory=gpu_memory,
            cpu_memory=args.cpu_memory,
            offload_folder=args.offload_folder,
            target="model",
            policy=args.policy,
            batches_per_block=args.batches_per_block,
        )
        callbacks.append(callback)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision=args.precision,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    vocab_size = getattr(model.config, "vocab_size", 1000)
    data = DataLoader(
        IndexedIds(args.samples, args.seq_len, vocab_size, args.seed + 1), batch_size=args.batch_size
    )
    outputs = cast(list[dict[str, torch.Tensor]], trainer.predict(CausalLMPredictor(model), data))
    merged = {key: torch.cat([o[key] for o in outputs]) for key in ("index", "ids", "logits")}
    stats = callback.last_stats if callback is not None else {}
    rank = trainer.global_rank
    for index, logits in zip(merged["index"].tolist(), merged["logits"], strict=True):
        print(f"rank {rank} sample {index}: next token {int(logits.argmax())}")
    print(f"rank {rank} stats: {json.dumps(stats)}")
    if args.save_dir is not None:
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(merged, args.save_dir / f"predictions-rank{rank}.pt")
        (args.save_dir / f"stats-rank{rank}.json").write_text(json.dumps(stats))


if __name__ == "__main__":
    main()
