"""What a person evaluating a model calls besides a forward and a greedy ``generate``: the coverage sweep's
``--calls user`` battery.

A loss over labels (perplexity; an encoder-decoder's labels are its decoder tokens), every layer's hidden
states, the output as a tuple (``return_dict=False``), beam search and seeded sampling. Each call runs on
the eager reference first; a call eager itself cannot make is left out of the offloaded run too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

CALLS_VARIABLE = "FXOFFLOAD_BENCH_CALLS"  # a sweep's calls, for its children ("plain" unset)
BEAMS, SAMPLE_SEED, TOP_K = 3, 5, 20
IGNORED = -100  # the label Transformers' losses skip (a padded position)


def battery_from_environment() -> bool:
    """Whether a sweep's parent asked for the user battery (``--calls user``)."""
    return os.environ.get(CALLS_VARIABLE, "plain") == "user"


def battery(model: Any, inputs: dict[str, Any], new_tokens: int) -> dict[str, Callable[[], Any]]:
    """The battery's calls for ``model`` (each returning one tensor), by name."""
    calls: dict[str, Callable[[], Any]] = {
        "hidden_states": lambda: _hidden_states(model, inputs),
        "tuple_output": lambda: _first_tensor(model(**inputs, return_dict=False)),
    }
    if _takes(model, "labels"):
        calls["loss"] = lambda: model(**_with_labels(model, inputs)).loss
    can = getattr(model, "can_generate", None)
    if callable(can) and can():
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        kept = {} if mask is None else {"attention_mask": mask}

        def beams() -> Any:
            return model.generate(ids, **kept, max_new_tokens=new_tokens, num_beams=BEAMS, do_sample=False)

        def sample() -> Any:
            import torch

            torch.manual_seed(SAMPLE_SEED)
            return model.generate(ids, **kept, max_new_tokens=new_tokens, do_sample=True, top_k=TOP_K)

        calls.update(beam_search=beams, sampling=sample)
    return calls


def run_reference(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each call's eager output; a call eager cannot make is recorded as its error's first line."""
    out: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            out[name] = call()
        except Exception as exc:  # noqa: BLE001 - eager's own limits leave the call out
            out[name] = (
                f"eager fails: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            )
    return out


def run_offloaded(
    calls: dict[str, Callable[[], Any]], reference: dict[str, Any], phase: Any
) -> dict[str, Any]:
    """The offloaded model's output of each call eager could make (``phase`` names each as it starts)."""
    out = {}
    for name, call in calls.items():
        if isinstance(reference.get(name), str):
            continue
        phase(f"user call: {name}")
        out[name] = call()
    return out


def compare(
    reference: dict[str, Any], got: dict[str, Any], same: Callable[[Any, Any], bool]
) -> dict[str, Any]:
    """Per call: true where bit for bit, false where not, eager's error where eager could not make it."""
    return {
        name: expected if isinstance(expected, str) else name in got and same(expected, got[name])
        for name, expected in reference.items()
    }


def _hidden_states(model: Any, inputs: dict[str, Any]) -> Any:
    """Every layer's hidden states (the decoder's, where there are two sides), flattened into one tensor."""
    import torch

    out = model(**inputs, output_hidden_states=True)
    states = getattr(out, "decoder_hidden_states", None) or out.hidden_states
    return torch.cat([s.reshape(-1) for s in states])


def _with_labels(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with labels: the token ids (padding ignored) for a decoder, the decoder's tokens (in place
    of them) for an encoder-decoder."""
    if getattr(model.config, "is_encoder_decoder", False) and "decoder_input_ids" in inputs:
        rest = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
        return {**rest, "labels": inputs["decoder_input_ids"]}
    labels = inputs["input_ids"].clone()
    mask = inputs.get("attention_mask")
    if mask is not None:
        labels[mask == 0] = IGNORED
    return {**inputs, "labels": labels}


def _takes(model: Any, name: str) -> bool:
    import inspect

    return name in inspect.signature(model.forward).parameters


def _first_tensor(out: Any) -> Any:
    import torch

    first = out[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"the tuple output starts with {type(first).__name__}, not a tensor")
    return first
