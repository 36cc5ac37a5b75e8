"""Vocabulary-heavy sweep: architectures beyond Llama, tried as a user would, at small budgets.

Each architecture is built from its Transformers config with a vocabulary large against its hidden size
(32,000 against 256, three layers; tied output heads where the architecture ties them), saved as
safetensors with random weights, loaded back by ``fxoffload_hf.from_pretrained`` (the default capture) at
``--share`` of its weights, and asked for a greedy ``generate`` of a left-padded batch of prompts of
different lengths. Each runs in a child of its own; the table says whether its tokens equal eager's for
the same batch, how many graphs it captured and how many calls ran as eager code, or the refusal::

    .venv/bin/python benchmarks/vocab_sweep.py --share 0.25
    .venv/bin/python benchmarks/vocab_sweep.py --share 0.1 --archs gpt2,gemma2 --plain-forward
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import measure

VOCAB, HIDDEN = 32000, 256
_SMALL = {"num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 512}
_GQA = {"num_key_value_heads": 2}
# config class name -> extra fields (hidden size and vocabulary are set for all)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {**_SMALL, **_GQA}),
    "qwen2": ("Qwen2Config", {**_SMALL, **_GQA}),
    "qwen3": ("Qwen3Config", {**_SMALL, **_GQA, "head_dim": 64}),
    "mistral": ("MistralConfig", {**_SMALL, **_GQA, "sliding_window": 8}),
    "phi3": ("Phi3Config", {**_SMALL, **_GQA, "pad_token_id": 0}),
    "phi": ("PhiConfig", _SMALL),
    "olmo2": ("Olmo2Config", {**_SMALL, **_GQA}),
    "stablelm": ("StableLmConfig", {**_SMALL, **_GQA}),
    "granite": ("GraniteConfig", {**_SMALL, **_GQA}),
    "gpt_neox": ("GPTNeoXConfig", _SMALL),
    "gemma2": ("Gemma2Config", {**_SMALL, **_GQA, "head_dim": 64, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", {**_SMALL, **_GQA, "head_dim": 64, "sliding_window": 8}),
    "cohere": ("CohereConfig", {**_SMALL, **_GQA}),
    "starcoder2": ("Starcoder2Config", {**_SMALL, **_GQA}),
    "falcon": ("FalconConfig", {"num_hidden_layers": 3, "num_attention_heads": 4}),
    "bloom": ("BloomConfig", {"n_layer": 3, "n_head": 4}),
    "opt": ("OPTConfig", {**_SMALL, "ffn_dim": 512, "word_embed_proj_dim": HIDDEN}),
    "gpt2": ("GPT2Config", {"n_layer": 3, "n_head": 4, "n_embd": HIDDEN}),
}
PROMPT_LENGTHS = (5, 11, 17)
PAD = 3


def child(arch: str, share: float, folder: Path, new_tokens: int, plain_forward: bool) -> dict[str, Any]:
    """One architecture: eager's answer for the batch, then fxoffload's at ``share`` of the weights."""
    import torch
    import transformers

    import fxoffload_hf

    config_class, fields = ARCHS[arch]
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(vocab_size=VOCAB, hidden_size=HIDDEN, **fields)
        transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    prompts = [measure.random_prompts(VOCAB, 1, n, n, seed=n)[0] for n in PROMPT_LENGTHS]
    batch = measure.left_padded(prompts, pad=PAD)
    gen = {**batch, "max_new_tokens": new_tokens}
    row: dict[str, Any] = {"arch": arch, "weights_mib": round(weights / 2**20, 1), "share": share}
    with torch.no_grad():
        expected = eager.generate(**gen)
        expected_logits = eager(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    budget = int(weights * share)
    row["budget_mib"] = _mib(budget)
    start = time.perf_counter()
    try:
        model = fxoffload_hf.from_pretrained(folder, cpu_memory=budget)
    except fxoffload_hf.BudgetTooSmallError as refusal:
        return {**row, "result": "refused at load", "needs_mib": _mib(refusal.smallest_budget)}
    try:
        with torch.no_grad():
            got = model.generate(**gen)
            same = bool(torch.equal(got, expected))
            if plain_forward:
                logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                same = same and bool(torch.equal(logits, expected_logits))
        engine = fxoffload_hf.engine_of(model)
        graphs, eager_calls = len(engine.runners), engine.stats.eager_calls
    except fxoffload_hf.BudgetTooSmallError as refusal:
        return {**row, "result": "refused", "needs_mib": _mib(refusal.smallest_budget)}
    finally:
        fxoffload_hf.restore(model)
    result = "exact" if same else "MISMATCH"
    seconds = round(time.perf_counter() - start, 1)
    return {**row, "result": result, "graphs": graphs, "eager_calls": eager_calls, "seconds": seconds}


def _mib(size: int) -> float:
    return round(size / 2**20, 2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--share", type=float, default=0.25, help="budget as this share of each model's weights"
    )
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated architectures")
    parser.add_argument("--new-tokens", type=int, default=8, help="greedy new tokens per sequence")
    parser.add_argument(
        "--plain-forward", action="store_true", help="also compare a plain forward's logits of the batch"
    )
    parser.add_argument("--models", type=Path, default=None, help="folder kept for the saved models")
    parser.add_argument("--limit-s", type=float, default=300, help="time limit of one child, seconds")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    models = args.models or Path(tempfile.mkdtemp(prefix="vocab-sweep-"))
    if args.child:
        row = child(args.child, args.share, models / args.child, args.new_tokens, args.plain_forward)
        print("RESULT " + json.dumps(row))
        return
    print(f"{'arch':<11} {'weights MiB':>11} {'budget MiB':>10}  result")
    for arch in args.archs.split(","):
        argv = [
            sys.executable,
            __file__,
            "--child",
            arch,
            "--share",
            str(args.share),
            "--models",
            str(models),
        ]
        argv += ["--new-tokens", str(args.new_tokens)] + (["--plain-forward"] if args.plain_forward else [])
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=args.limit_s, check=False)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
            row = (
                json.loads(line[7:])
                if line
                else {"arch": arch, "result": "error", "detail": done.stderr[-300:]}
            )
        except subprocess.TimeoutExpired:
            row = {"arch": arch, "result": "hang"}
        what = row["result"]
        if what == "exact" or what == "MISMATCH":
            what += f" ({row['graphs']} graphs, {row['eager_calls']} eager calls, {row['seconds']} s)"
        elif "needs_mib" in row:
            what += f" (its smallest budget named: {row['needs_mib']} MiB)"
        elif "detail" in row:
            what += ": " + row["detail"]
        print(
            f"{arch:<11} {row.get('weights_mib', ''):>11} {row.get('budget_mib', ''):>10}  {what}", flush=True
        )


if __name__ == "__main__":
    main()
