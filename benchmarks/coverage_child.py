"""One check of the coverage sweep, in its own process: a tiny ``TYPE`` checkpoint, eager beside fxoffload.

Run by ``benchmarks/coverage.py`` as ``coverage_child.py TYPE MAPPING FOLDER``; it prints ``phase``
records as it goes (a kill on timeout then says where it hung) and one ``result`` record at the end.
Steps: a tiny config (``harness.shrink``), a seeded model from the auto class's ``from_config`` (its
eager forward must run, else the type is skipped), ``save_pretrained`` into ``FOLDER``, the reference
(Hugging Face's own ``from_pretrained`` of that folder, eager, in the sweep's dtype: fp32 unless
``--dtype`` says), then
``fxoffload_hf.from_pretrained(FOLDER, offload="fx", cpu_memory=...)`` at a budget that splits the model
and leaves weights on disk, two forwards and a greedy ``generate`` compared with the reference.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from harness.protocol import emit, phase
from harness.shrink import batch_from_environment, dtype_from_environment
from harness.user_calls import battery, battery_from_environment, run_offloaded, run_reference

AUTO_CLASSES = {"causal": "AutoModelForCausalLM", "seq2seq": "AutoModelForSeq2SeqLM", "base": "AutoModel"}
SEQ_LEN, DECODER_LEN, NEW_TOKENS, LOW_ID = 12, 5, 4, 3
BUDGET_SHARE = 0.4  # of the weights' bytes: several pieces, most weights left on disk
CLOSE = 1e-3  # largest difference, relative to the reference's largest value, still called close
DELIBERATE = (
    ValueError,
    NotImplementedError,
)  # what fxoffload_hf raises on purpose (its errors are ValueErrors)


class Skip(Exception):
    """The type cannot be checked: its tiny model does not build or run eagerly."""


def main(type_name: str, mapping: str, folder: Path, share: float | None = None) -> None:
    """Check one type; ``share``: the budget as that share of the weights exactly (their activation floor
    where it names one), else ``BUDGET_SHARE`` with room for 2.5 of the largest weights."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore", FutureWarning)
    torch.manual_seed(0)
    auto = getattr(transformers, AUTO_CLASSES[mapping])
    record: dict[str, Any] = {"event": "result", "type": type_name, "mapping": mapping}
    record["source_digest"] = source_digest()
    try:
        model, config = build(type_name, mapping, auto, record)
        inputs = make_inputs(config, model)
        try:
            with torch.no_grad():
                output_of(model(**inputs))
        except Exception as exc:  # noqa: BLE001 - any failure of eager itself skips the type
            raise Skip(f"eager fails ({first_line(exc)})") from exc
        phase("save")
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder, max_shard_size=max(weights // 4, largest + 1))
        record.update(params=sum(p.numel() for p in model.parameters()), weight_bytes=weights)
        reference = eager_reference(auto, folder, model, inputs, record)
        del model
        budget = (
            int(weights * share)
            if share is not None
            else max(int(weights * BUDGET_SHARE), int(2.5 * largest) + 256 * 1024)
        )
        record.update(budget_share=share, dtype=str(dtype_from_environment()).removeprefix("torch."))
        if batch_from_environment() > 1:
            record["batch"] = batch_from_environment()
        record.update(check_offloaded(auto, folder, inputs, reference, budget, record))
    except Skip as exc:
        record.update(status="skipped", reason=str(exc), traceback=tail(exc))
    emit(record)


def source_digest() -> str:
    """A short hash of fxoffload_hf's sources as this child imports them (the tree may change mid-sweep)."""
    import hashlib

    import fxoffload_hf

    digest = hashlib.sha256()
    for path in sorted(Path(fxoffload_hf.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def build(type_name: str, mapping: str, auto: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """The tiny config and seeded random-init model of ``type_name`` (eval, in the sweep's dtype)."""
    import torch
    from harness.shrink import shape_from_environment, shrink_config
    from transformers import CONFIG_MAPPING

    phase("config")
    try:
        config = shrink_config(CONFIG_MAPPING[type_name](), shape_from_environment())
        if mapping == "causal" and not getattr(config, "is_encoder_decoder", False):
            config.is_decoder = True  # BERT-likes as causal LMs (Reformer refuses otherwise)
        if (
            getattr(config, "is_encoder_decoder", False)
            and getattr(config, "decoder_start_token_id", None) is None
        ):
            config.decoder_start_token_id = config.pad_token_id or 0  # T5's own choice; generate needs one
        phase("build")
        torch.manual_seed(0)
        model = auto.from_config(config, dtype=dtype_from_environment()).eval()
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"cannot build ({first_line(exc)}){default_broken(type_name, auto)}") from exc
    record["model_class"] = type(model).__name__
    return model, config


def default_broken(type_name: str, auto: Any) -> str:
    """'; default config fails too' when transformers' own default config does not build (on meta)."""
    import torch
    from transformers import CONFIG_MAPPING

    try:
        with torch.device("meta"):
            auto.from_config(CONFIG_MAPPING[type_name]())
    except Exception:  # noqa: BLE001
        return "; the default config fails too"
    return ""


def make_inputs(config: Any, model: Any = None) -> dict[str, Any]:
    """Seeded token ids inside the vocabulary (above the usual special ids); decoder ids for
    encoder-decoders. Where the sweep asks for a batch, its prompts are of different lengths (the longest
    ``SEQ_LEN``), left-padded with their attention mask, as a user batches prompts for ``generate``
    (``model``, where given, must take the mask)."""
    import torch

    vocab = _vocab(config)
    gen = torch.Generator().manual_seed(1)
    batch = batch_from_environment()
    lengths = [max(LOW_ID, SEQ_LEN - SEQ_LEN * i // batch) for i in range(batch)]
    ids = torch.full((batch, SEQ_LEN), _pad_id(config, vocab), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, SEQ_LEN - length :] = torch.randint(LOW_ID, vocab, (length,), generator=gen)
        mask[row, SEQ_LEN - length :] = 1
    inputs = {"input_ids": ids}
    if batch > 1:
        if model is not None and "attention_mask" not in inspect.signature(model.forward).parameters:
            raise Skip("its forward takes no attention mask: prompts of different lengths cannot be batched")
        inputs["attention_mask"] = mask
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(LOW_ID, vocab, (batch, DECODER_LEN), generator=gen)
    return inputs


def _pad_id(config: Any, vocab: int) -> int:
    pad = getattr(config, "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < vocab else 0


def _vocab(config: Any) -> int:
    for source in (config, getattr(config, "text_config", None), getattr(config, "decoder", None)):
        size = getattr(source, "vocab_size", None)
        if isinstance(size, int) and size > LOW_ID:
            return size
    return 1000


def output_of(out: Any) -> Any:
    """The tensor compared: logits, else the last hidden state, else the first tensor of the output."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        value = getattr(out, name, None)
        if isinstance(value, torch.Tensor):
            return value
    values = out.values() if hasattr(out, "values") else out
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"no tensor in the output ({type(out).__name__})")


def generates(model: Any) -> bool:
    can = getattr(model, "can_generate", None)
    return bool(callable(can) and can())


def greedy(model: Any, inputs: dict[str, Any]) -> Any:
    import torch

    ids = inputs["input_ids"]
    mask = inputs.get("attention_mask", torch.ones_like(ids))
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1)


def eager_reference(
    auto: Any, folder: Path, built: Any, inputs: dict[str, Any], record: dict[str, Any]
) -> dict[str, Any]:
    """Hugging Face's own load of the folder, eager: its output and greedy tokens."""
    import torch

    phase("reference")
    try:
        model = auto.from_pretrained(folder, dtype=dtype_from_environment()).eval()
        with torch.no_grad():
            out = output_of(model(**inputs))
            record["roundtrip_exact"] = same(out, output_of(built(**inputs)))
            tokens = greedy(model, inputs) if generates(model) else None
            user = run_reference(battery(model, inputs, NEW_TOKENS)) if battery_from_environment() else {}
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"eager reload or generate fails ({first_line(exc)})") from exc
    return {"output": out, "tokens": tokens, "user_calls": user}


def check_offloaded(
    auto: Any,
    folder: Path,
    inputs: dict[str, Any],
    reference: dict[str, Any],
    budget: int,
    record: dict[str, Any],
) -> dict[str, Any]:
    """Load offloaded at ``budget``, compare; the status and its facts. Failures become refused / error
    records."""

    import fxoffload_hf

    seen: list[warnings.WarningMessage] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = None
        try:
            model, first, second, tokens, user = load(
                fxoffload_hf, auto, folder, budget, inputs, record, reference
            )
            result = compare(reference, first, second, tokens, user)
            result.update(engine_facts(fxoffload_hf, model))
        except Exception as exc:  # noqa: BLE001 - every failure is a finding
            result = failure(exc)
        finally:
            seen = list(caught)
            if model is not None:
                try:
                    fxoffload_hf.restore(model)
                except Exception as exc:  # noqa: BLE001
                    record["restore_error"] = first_line(exc)
    result.update(warning_facts(seen))
    result.update(dynamo_facts())
    if result["status"] in ("close", "mismatch"):
        result["dynamo_eager_diff"] = dynamo_control(auto, folder, inputs, reference["output"])
    return result


def dynamo_control(auto: Any, folder: Path, inputs: dict[str, Any], expected: Any) -> float | str:
    """The same model under ``torch.compile(backend="eager", dynamic=True)``, no offloading: its largest
    difference from eager tells a capture difference from an offloading one."""
    import torch

    phase("control")
    try:
        torch._dynamo.reset()
        model = auto.from_pretrained(folder, dtype=dtype_from_environment()).eval()
        with torch.no_grad():
            return max_diff(
                expected, output_of(torch.compile(model, backend="eager", dynamic=True)(**inputs))
            )
    except Exception as exc:  # noqa: BLE001
        return f"control failed: {type(exc).__name__}: {first_line(exc)}"


def load(
    fxoffload_hf: Any,
    auto: Any,
    folder: Path,
    budget: int,
    inputs: dict[str, Any],
    record: dict[str, Any],
    reference: dict[str, Any],
) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """The offloaded model at ``budget``, its two forward outputs (the profiled call, the planned one),
    its greedy tokens (None where eager's reference has none) and its outputs of the user battery's calls
    eager could make (``--calls user``). A budget refused as too small is tried again (six
    times at most) at exactly the smallest budget the refusal names."""
    import torch

    # a refusal at load counts the weights alone, one at the first call adds the activations, one at
    # generate's calls the KV cache they pass, and a call cut by graph breaks learns each graph's
    # activations when it reaches it (longformer: 45 breaks, three refusals in its first call): follow each
    refusals = 6
    for attempt in range(refusals + 1):
        record["budget"] = budget
        model = None
        where = "load"
        try:
            phase("load")
            model = fxoffload_hf.from_pretrained(
                folder,
                offload="fx",
                cpu_memory=budget,
                device="cpu",
                auto_class=auto,
                dtype=dtype_from_environment(),
            )  # capture: FXOFFLOAD_HF_CAPTURE, which coverage.py sets (--capture)
            where = "first call"
            phase(where)
            with torch.no_grad():
                first = output_of(model(**inputs))
                where = "forward"
                phase(where)
                second = output_of(model(**inputs))
                tokens = None
                if reference["tokens"] is not None:
                    where = "generate"
                    phase(where)
                    tokens = greedy(model, inputs)
                where = "user calls"
                user = run_offloaded(battery(model, inputs, NEW_TOKENS), reference["user_calls"], phase)
            return model, first, second, tokens, user
        except fxoffload_hf.BudgetTooSmallError as exc:
            if model is not None:
                fxoffload_hf.restore(model)
            if attempt == refusals:
                raise
            record.setdefault("budget_raised_from", budget)
            record["first_refusal"] = {
                "phase": where,
                "smallest_budget": exc.smallest_budget,
                "error": str(exc),
            }
            budget = exc.smallest_budget
    raise AssertionError("unreachable")


def compare(
    reference: dict[str, Any], first: Any, second: Any, tokens: Any, user: dict[str, Any]
) -> dict[str, Any]:
    import torch
    from harness.user_calls import compare as compare_user_calls

    expected = reference["output"]
    diff = max(max_diff(expected, first), max_diff(expected, second))
    scale = max(1.0, float(expected.float().abs().nan_to_num().max()))
    result: dict[str, Any] = {"forward_exact": same(expected, first) and same(expected, second)}
    result["max_diff"] = diff
    if reference["tokens"] is not None:
        result["generate_equal"] = tokens is not None and torch.equal(tokens, reference["tokens"])
    close = diff <= CLOSE * scale
    status = "exact" if result["forward_exact"] else "close" if close else "mismatch"
    if reference["user_calls"]:
        result["user_calls"] = compare_user_calls(reference["user_calls"], user, same)
    if result.get("generate_equal") is False or False in result.get("user_calls", {}).values():
        status = "mismatch"
    result["status"] = status
    return result


def same(a: Any, b: Any) -> bool:
    """Bit for bit, NaN where NaN."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()))


def max_diff(a: Any, b: Any) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().nan_to_num(nan=float("inf")).max()) if a.numel() else 0.0


def engine_facts(fxoffload_hf: Any, model: Any) -> dict[str, Any]:
    report = fxoffload_hf.engine_of(model).report()
    return {
        "graphs": report["stats"]["graphs"],
        "pieces": report["pieces"],
        "store": report["store"],
        "bytes_streamed": report["stats"]["bytes_streamed"],
    }


def warning_facts(seen: list[warnings.WarningMessage]) -> dict[str, Any]:
    """Modules that ran eagerly (one ``EagerFallbackWarning`` each), and any other warning of ours."""
    fallback = [
        " ".join(str(w.message).split()[:2]) for w in seen if w.category.__name__ == "EagerFallbackWarning"
    ]
    # generate's micro-batch warning points at the caller's line (stacklevel), not at fxoffload_hf
    ours = {
        f"{w.category.__name__}: {first_line(w.message)}"
        for w in seen
        if ("fxoffload_hf" in (w.filename or "") or "micro-batch" in str(w.message))
        and w.category.__name__ != "EagerFallbackWarning"
    }
    return {"eager_fallback": fallback, "warnings": sorted(ours)[:5]}


def dynamo_facts() -> dict[str, Any]:
    """Dynamo's graph breaks (count and the most frequent reasons)."""
    from torch._dynamo.utils import counters

    breaks: dict[str, int] = dict(counters.get("graph_break", {}))
    top = sorted(breaks.items(), key=lambda kv: -kv[1])[:3]
    return {"graph_breaks": sum(breaks.values()), "break_reasons": [first_line(k)[:160] for k, _ in top]}


def failure(exc: BaseException) -> dict[str, Any]:
    """A refusal (fxoffload_hf raised a ValueError or NotImplementedError on purpose) or an error."""
    root = root_cause(exc)
    raised_by_us = "fxoffload_hf" + os.sep in innermost_file(root)
    kind = "refused" if raised_by_us and isinstance(root, DELIBERATE) else "error"
    result = {"status": kind, "error_type": type(root).__name__, "error": first_line(root)}
    if root is not exc:
        result["wrapped_in"] = type(exc).__name__
    result["raised_in"] = innermost_file(root)
    result["traceback"] = tail(exc)
    return result


def root_cause(exc: BaseException) -> BaseException:
    """The exception under dynamo's wrappers (``BackendCompilerFailed`` and other ``raise ... from``)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None:
            break
        exc = inner
    return exc


def innermost_file(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def first_line(value: object) -> str:
    text = str(value).strip()
    return text.splitlines()[0][:300] if text else type(value).__name__


def tail(exc: BaseException, lines: int = 14) -> str:
    """The end of the traceback of the exception under the wrappers (and the wrapper's own line)."""
    root = root_cause(exc)
    text = "".join(traceback.format_exception(root, chain=False)).rstrip().splitlines()[-lines:]
    if root is not exc:
        text.append(f"(wrapped in {type(exc).__name__}: {first_line(exc)[:200]})")
    return "\n".join(text)


if __name__ == "__main__":
    start = time.perf_counter()
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else None)
    print(f"done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
