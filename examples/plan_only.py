"""Print how a model would be offloaded, without loading or running it (shapes on the meta device).

python examples/plan_only.py MODEL_DIR --gpu-memory 24GiB --seq-len 512
python examples/plan_only.py --llama-70b --gpu-memory 24GiB      # a 70B architecture, no files needed
"""

from __future__ import annotations

import argparse
import json

from fxoffload_hf.plan import plan_checkpoint, plan_config


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model_dir", nargs="?")
    parser.add_argument("--llama-70b", action="store_true", help="plan a Llama-70B-shaped model instead")
    parser.add_argument("--gpu-memory", default=None)
    parser.add_argument("--cpu-memory", default=None)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="plan for this device")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    budgets = {
        "gpu_memory": args.gpu_memory,
        "cpu_memory": args.cpu_memory,
        "seq_len": args.seq_len,
        "device": args.device,
    }
    if args.llama_70b:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
            num_attention_heads=64, num_key_value_heads=8, dtype="bfloat16",
        )  # fmt: skip
        report = plan_config(config, **budgets)
    elif args.model_dir:
        report = plan_checkpoint(args.model_dir, **budgets)
    else:
        parser.error("give MODEL_DIR or --llama-70b")
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.table())


if __name__ == "__main__":
    main()
