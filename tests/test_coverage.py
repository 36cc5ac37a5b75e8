"""A fast subset of the coverage sweep (``benchmarks/coverage.py``) across families: each type built
tiny from its own config class, saved, loaded with ``from_pretrained(offload="fx")`` under a budget that
splits it and leaves weights on disk, and compared bit for bit with Hugging Face's own eager load.

Every type runs its forward twice (the profiled call and the planned one). Greedy ``generate`` (two
more graphs: prefill with a cache, decode) runs for one type of each cache family not generated
elsewhere; ``tests/test_transformers_integration.py`` generates with eight more dense, MoE and
encoder-decoder architectures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.weight_record import Tier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from coverage_child import AUTO_CLASSES, build, greedy, make_inputs, output_of  # noqa: E402

FAMILIES = {
    "dense": [
        "llama", "gpt2", "gemma2", "cohere2", "falcon", "bloom", "gpt_neox", "gptj", "olmo2", "biogpt",
        "glm4", "granite",
    ],
    "mixture of experts": ["mixtral", "olmoe", "deepseek_v3", "granitemoe", "glm4_moe", "gpt_oss", "minimax"],
    "state space": ["mamba", "falcon_mamba"],
    "hybrid": ["jamba", "lfm2", "nemotron_h"],
    "encoder as decoder": ["bert"],
    "multimodal text tower": ["gemma3_text", "llama4_text", "aria_text"],
}  # fmt: skip
CASES = [("causal", t) for types in FAMILIES.values() for t in types]
CASES += [("seq2seq", "t5"), ("seq2seq", "bart"), ("base", "bert"), ("base", "t5")]
# generate: a state-space cache, a hybrid (convolution and attention) cache, sliding-window layers of a
# multimodal text tower, latent attention with experts, and an encoder-decoder besides T5
GENERATE = {
    ("causal", "mamba"), ("causal", "lfm2"), ("causal", "gemma3_text"), ("causal", "deepseek_v3"), ("seq2seq", "bart"),
}  # fmt: skip


def _run_offloaded(folder: Path, auto, inputs: dict, budget: int, generate: bool):
    """The offloaded model and what it gave: two forwards (the profiled call, the planned one) and greedy
    tokens (or None). A refusal is followed to the budget it names: at load (the weights alone), at the
    first call (with its activations), at generate's calls (with the cache they pass)."""
    for _hop in range(4):
        model = None
        try:
            model = fxoffload_hf.from_pretrained(
                folder, offload="fx", cpu_memory=budget, device="cpu", auto_class=auto
            )
            with torch.no_grad():
                outputs = [output_of(model(**inputs)), output_of(model(**inputs))]
                return model, outputs, greedy(model, inputs) if generate else None
        except fxoffload_hf.BudgetTooSmallError as exc:
            if model is not None:
                fxoffload_hf.restore(model)
            assert exc.smallest_budget > budget
            budget = exc.smallest_budget
    raise AssertionError(f"no working budget from {budget}")


@pytest.mark.parametrize(("mapping", "type_name"), CASES, ids=[f"{m}-{t}" for m, t in CASES])
def test_type_runs_offloaded_exactly_as_eager(mapping, type_name, tmp_path):
    import transformers

    auto = getattr(transformers, AUTO_CLASSES[mapping])
    built, config = build(type_name, mapping, auto, {})
    inputs = make_inputs(config)
    weights = sum(p.numel() * p.element_size() for p in built.parameters())
    largest = max(p.numel() * p.element_size() for p in built.parameters())
    built.save_pretrained(tmp_path, max_shard_size=max(weights // 4, largest + 1))
    reference = auto.from_pretrained(tmp_path, dtype=torch.float32).eval()
    generate = (mapping, type_name) in GENERATE
    with torch.no_grad():
        expected = output_of(reference(**inputs))
        tokens = greedy(reference, inputs) if generate else None
    del built, reference
    model, outputs, got = _run_offloaded(tmp_path, auto, inputs, int(weights * 0.3), generate)
    try:
        assert all(torch.equal(output, expected) for output in outputs)
        if generate:
            assert torch.equal(got, tokens)
        engine = fxoffload_hf.engine_of(model)
        assert max(r.program.pieces for r in engine.runners) >= 2
        assert engine.store.bytes_in(Tier.DISK) > 0
    finally:
        fxoffload_hf.restore(model)


def test_the_subset_spans_at_least_thirty_types_across_families():
    assert len({t for _, t in CASES}) >= 30 and len(FAMILIES) >= 6
    assert set(CASES) >= GENERATE


@pytest.mark.parametrize(("mapping", "type_name"), [("causal", "llama"), ("seq2seq", "t5")])
def test_a_users_evaluation_calls_equal_eager(mapping, type_name, tmp_path, monkeypatch, default_capture):
    """The sweep's ``--calls user`` battery (a loss over labels, every layer's hidden states, a tuple
    output, beam search, seeded sampling) on a padded batch of three prompts, in the default capture mode
    at a quarter of the weights: each call bit for bit as eager's."""
    import transformers
    from coverage_child import NEW_TOKENS, same
    from harness.shrink import BATCH_VARIABLE
    from harness.user_calls import battery, compare, run_offloaded, run_reference

    monkeypatch.setenv(BATCH_VARIABLE, "3")
    auto = getattr(transformers, AUTO_CLASSES[mapping])
    built, config = build(type_name, mapping, auto, {})
    inputs = make_inputs(config, built)
    weights = sum(p.numel() * p.element_size() for p in built.parameters())
    built.save_pretrained(tmp_path)
    with torch.no_grad():
        expected = run_reference(battery(built, inputs, NEW_TOKENS))
    assert not any(isinstance(v, str) for v in expected.values()), expected  # eager makes every call
    del built
    budget = weights // 4
    for _hop in range(4):
        model = fxoffload_hf.from_pretrained(
            tmp_path, offload="fx", cpu_memory=budget, device="cpu", auto_class=auto
        )
        try:
            with torch.no_grad():
                got = run_offloaded(battery(model, inputs, NEW_TOKENS), expected, lambda _name: None)
            break
        except fxoffload_hf.BudgetTooSmallError as exc:
            assert exc.smallest_budget > budget
            budget = exc.smallest_budget
        finally:
            fxoffload_hf.restore(model)
    assert compare(expected, got, same) == dict.fromkeys(expected, True)
    assert {"loss", "hidden_states", "beam_search", "sampling"} <= set(expected)
