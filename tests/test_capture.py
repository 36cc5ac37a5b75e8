"""Capture: one canonical form per call, and a bounded number of graphs whatever the call pattern."""

from __future__ import annotations

import functools
import shutil

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.capture import canonical_call, compile_entry, graph_check


def _forward(input_ids, attention_mask=None, *, use_cache=None, **kwargs):
    return input_ids, attention_mask, use_cache, kwargs


def _decorated(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # what Transformers' decorators look like to dynamo
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("fn", [_forward, _decorated(_forward)], ids=["plain", "decorated"])
def test_positional_and_keyword_calls_are_written_one_way(fn):
    canonical = canonical_call(fn)
    assert canonical((1,), {}) == canonical((), {"input_ids": 1}) == ((), {"input_ids": 1})
    both = ((), {"input_ids": 1, "attention_mask": None})
    assert canonical((1, None), {}) == canonical((), {"attention_mask": None, "input_ids": 1}) == both
    args, kwargs = canonical((1, 2), {"use_cache": True})
    assert fn(*args, **kwargs) == fn(1, 2, use_cache=True)


def test_extra_keywords_are_kept_and_bad_calls_are_left_to_fail_as_themselves():
    canonical = canonical_call(_forward)
    assert canonical((1,), {"output_attentions": True}) == ((), {"input_ids": 1, "output_attentions": True})
    assert canonical((1, 2, 3), {}) == ((1, 2, 3), {})  # too many positionals: the call raises its own error


def test_graph_check_tells_the_calls_a_captured_graph_serves():
    def scaled(x, mask=None, *, factor=2):  # a code object of its own: dynamo caches graphs per code
        return x * factor if mask is None else x * mask

    fn = _decorated(scaled)
    compiled = compile_entry(fn, "eager")  # calls written in the canonical form, as graph_check asks
    served = graph_check(fn)
    x = torch.ones(3, 5)
    assert not served((x,), {})  # nothing captured yet
    compiled(x)
    assert served((x,), {}) and served((), {"x": torch.ones(4, 7)})  # sizes are symbolic
    assert not served((x, torch.ones(3, 5)), {})  # a mask where none was: dynamo would capture anew
    assert not served((x,), {"factor": 3})  # an int dynamo specialised on
    assert not served((x, 1, 2, 3), {})  # a call that cannot bind: left to fail as itself
    compiled(x, torch.ones(3, 5))
    assert served((x, torch.ones(3, 5)), {})


@pytest.fixture(scope="module")
def llama_dir(llama_master, tmp_path_factory):
    folder = tmp_path_factory.mktemp("capture") / "llama"
    shutil.copytree(llama_master[0], folder)
    return folder


def _word_tokenizer():
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(1000)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="w0", pad_token="w0", eos_token="w1", padding_side="left"
    )


def _calls(model, tok, lengths, batch, generator):
    """Every way the test calls a causal LM: forward three ways, generate, a text-generation pipeline."""
    import transformers as tf

    outputs = []
    for length in lengths:
        ids = torch.randint(0, 1000, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        outputs += [model(ids).logits, model(input_ids=ids).logits, model(ids, attention_mask=mask).logits]
        outputs.append(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False))
    words = [
        " ".join(f"w{int(i)}" for i in torch.randint(2, 1000, (n,), generator=generator)) for n in lengths
    ]
    pipe = tf.pipeline("text-generation", model=model, tokenizer=tok)
    outputs.append(pipe(words, max_new_tokens=4, do_sample=False, batch_size=batch))
    return outputs


def _same(got, expected) -> bool:
    if isinstance(got, torch.Tensor):
        return torch.equal(got, expected)
    return got == expected


@pytest.mark.slow
def test_new_lengths_batches_and_call_forms_reuse_the_graphs_captured(llama_dir):
    import transformers as tf

    eager = tf.AutoModelForCausalLM.from_pretrained(llama_dir)
    model = fxoffload_hf.from_pretrained(llama_dir, cpu_memory=1_400_000, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    tok = _word_tokenizer()
    try:
        with torch.no_grad():
            for batch in (1, 2):
                got = _calls(model, tok, (6, 11), batch, torch.Generator().manual_seed(batch))
                expected = _calls(eager, tok, (6, 11), batch, torch.Generator().manual_seed(batch))
                assert all(_same(g, e) for g, e in zip(got, expected, strict=True))
            seen = len(engine.runners)
            for batch in (1, 3):  # lengths shorter and longer than any seen, a batch size not seen
                got = _calls(model, tok, (4, 23), batch, torch.Generator().manual_seed(10 + batch))
                expected = _calls(eager, tok, (4, 23), batch, torch.Generator().manual_seed(10 + batch))
                assert all(_same(g, e) for g, e in zip(got, expected, strict=True))
            after = len(engine.runners)
    finally:
        fxoffload_hf.restore(model)
    # the graphs differ only in what dynamo must specialise: a mask or none, position ids or none, one
    # sequence or a batch (a size of 1), prefill or decode; never in lengths, batch sizes or how the call
    # is written
    assert after == seen, (seen, after)
    assert seen <= 12, seen
