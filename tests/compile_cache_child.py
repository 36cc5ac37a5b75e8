"""A process that loads a checkpoint offloaded with a compile cache and answers once
(``tests/test_compile_cache.py``): writes its tokens and logits to OUT, with the graphs dynamo captured.

Usage: python compile_cache_child.py CHECKPOINT CACHE_DIR BUDGET OUT THREADS [break-mlp] (THREADS: the
caller's, whose eager results it is compared with: products may round differently in another number of
threads; ``break-mlp``: a graph break in every Llama MLP, so each call runs as many frames, each layer's
MLP resumed from the same code; then only the plain call runs)
"""

from __future__ import annotations

import json
import os
import sys

os.environ["FXOFFLOAD_HF_CAPTURE"] = "first-call"
os.environ["FXOFFLOAD_HF_COUNT_GRAPH_STATE"] = "0"

import torch  # noqa: E402

import fxoffload_hf  # noqa: E402


def _break_every_mlp() -> None:
    from transformers.models.llama.modeling_llama import LlamaMLP

    plain = LlamaMLP.forward

    def breaking_forward(self: LlamaMLP, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # as a mixture of experts routed by ``.tolist()`` breaks
        return plain(self, x)

    LlamaMLP.forward = breaking_forward


def main() -> None:
    checkpoint, cache, budget, out, threads = sys.argv[1:6]
    breaks = sys.argv[6:] == ["break-mlp"]
    if breaks:
        _break_every_mlp()
    torch.set_num_threads(int(threads))
    model = fxoffload_hf.from_pretrained(
        checkpoint, offload="fx", cpu_memory=int(budget), compile_cache=cache
    )
    ids = torch.tensor([[0, 0, 5, 9, 13, 4], [3, 7, 11, 2, 8, 6]])
    mask = (ids != 0).long()
    with torch.no_grad():
        # broken, each call is many frames to capture: only the plain call
        tokens = (
            None if breaks else model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        )
        logits = model(ids[1:, :5]).logits  # a kind of call of its own: one sequence, no mask
    torch.save({"tokens": tokens, "logits": logits}, out + ".pt")
    captured = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with open(out + ".json", "w") as f:
        json.dump({"captured": captured}, f)


if __name__ == "__main__":
    main()
