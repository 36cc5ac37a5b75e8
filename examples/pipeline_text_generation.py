"""A transformers text-generation pipeline on an offloaded model.

python examples/pipeline_text_generation.py MODEL_DIR --cpu-memory 8GiB --prompt "Once upon a time"
"""

from __future__ import annotations

import argparse

import transformers

import fxoffload_hf


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir")
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--gpu-memory", default=None)
    parser.add_argument("--cpu-memory", default=None)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()

    model = fxoffload_hf.from_pretrained(
        args.model_dir, gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory, device=args.device
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    generator = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    result = generator(args.prompt, max_new_tokens=args.max_new_tokens, do_sample=False)
    print(result[0]["generated_text"])


if __name__ == "__main__":
    main()
