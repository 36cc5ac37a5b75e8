"""Run a large causal LM from a local folder with its weights streamed under memory budgets.

    python examples/run_llm.py /models/Llama-3.1-70B --gpu-memory 20GiB --cpu-memory 64GiB --prompt "Hello"

Without a tokenizer in the folder, the prompt is random token ids (useful with random-init checkpoints).
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import fxoffload_hf


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir")
    parser.add_argument("--prompt", default="The three laws of robotics are")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--gpu-memory", default=None)
    parser.add_argument("--cpu-memory", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, help="e.g. bfloat16; converts while streaming")
    args = parser.parse_args()

    model = fxoffload_hf.from_pretrained(
        args.model_dir,
        gpu_memory=args.gpu_memory,
        cpu_memory=args.cpu_memory,
        device=args.device,
        dtype=args.dtype,
    )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    except (OSError, ValueError):
        tokenizer, ids = None, torch.randint(0, model.config.vocab_size, (1, 8))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
    seconds = time.perf_counter() - start
    new = out.shape[-1] - ids.shape[-1]
    print(tokenizer.decode(out[0]) if tokenizer else out[0].tolist())
    stats = fxoffload_hf.engine_of(model).stats.as_dict()
    print(f"{new} tokens in {seconds:.2f} s; streamed {stats['bytes_streamed']} bytes; "
          f"copy hidden {stats['hidden_copy_share']:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
