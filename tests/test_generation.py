"""generate() through an offloaded model: sampling, beam search, caches, dtypes, pipelines, graph counts."""

from __future__ import annotations

import shutil

import pytest
import torch

import fxoffload_hf

IDS = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def llama_dir(llama_master, tmp_path_factory):
    """This module's copy of the tiny Llama checkpoint (only read)."""
    folder = tmp_path_factory.mktemp("generation") / "llama"
    shutil.copytree(llama_master[0], folder)
    return folder


def _load(folder, **kwargs):
    return fxoffload_hf.from_pretrained(folder, cpu_memory=1_400_000, device="cpu", **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        {"do_sample": True, "top_k": 20, "temperature": 0.8},
        {"num_beams": 3, "do_sample": False},
        {"do_sample": False, "cache_implementation": "static"},
    ],
    ids=["sampling", "beam", "static-cache"],
)
def test_generate_options_give_eager_tokens(llama_dir, options):
    import transformers as tf

    eager = tf.AutoModelForCausalLM.from_pretrained(llama_dir)
    torch.manual_seed(7)
    expected = eager.generate(IDS, max_new_tokens=6, **options)
    model = _load(llama_dir)
    try:
        torch.manual_seed(7)
        with torch.no_grad():
            tokens = model.generate(IDS, max_new_tokens=6, **options)
        assert torch.equal(tokens, expected)
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_checkpoints_saved_in_half_precision(dtype, tmp_path, save_checkpoint):
    import transformers as tf

    model = save_checkpoint("llama", tmp_path / "fp32")
    model.to(dtype).save_pretrained(tmp_path / "half", max_shard_size="300KB")
    eager = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "half")
    assert eager.dtype == dtype
    offloaded = fxoffload_hf.from_pretrained(tmp_path / "half", cpu_memory=1_000_000, device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(offloaded(IDS).logits, eager(IDS).logits)
    finally:
        fxoffload_hf.restore(offloaded)


def test_dtype_converts_while_streaming(llama_dir):
    import transformers as tf

    eager = tf.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16)
    model = fxoffload_hf.from_pretrained(llama_dir, cpu_memory=2_000_000, device="cpu", dtype=torch.bfloat16)
    try:
        records = fxoffload_hf.engine_of(model).store.records.values()
        assert all(r.dtype == torch.bfloat16 for r in records)
        assert any(r.disk is not None and r.disk.dtype == torch.float32 for r in records)  # file untouched
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, eager(IDS).logits)
            assert torch.equal(
                model.generate(IDS, max_new_tokens=5, do_sample=False),
                eager.generate(IDS, max_new_tokens=5, do_sample=False),
            )
    finally:
        fxoffload_hf.restore(model)


def test_two_hundred_decode_steps_compile_a_bounded_number_of_graphs(llama_dir):
    model = _load(llama_dir)
    try:
        with torch.no_grad():
            model.generate(IDS, max_new_tokens=200, min_new_tokens=200, do_sample=False)
            # 32 is the head dimension: a cache length equal to another size must not be tied to it
            for length in (3, 17, 30, 32):
                ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(length))
                model.generate(ids, max_new_tokens=5, do_sample=False)
        # one prefill and one decode graph, sizes symbolic from the first call: never one per step or length
        assert len(fxoffload_hf.engine_of(model).runners) == 2
    finally:
        fxoffload_hf.restore(model)


def test_a_prompt_as_long_as_the_head_dimension_compiles_two_graphs(llama_dir):
    model = _load(llama_dir)
    ids = torch.randint(0, 1000, (1, 32), generator=torch.Generator().manual_seed(32))
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        # dynamo's duck sizing would give the cache length and the head dimension (both 32) one symbol,
        # and the first decode step would be captured for that length alone
        assert len(fxoffload_hf.engine_of(model).runners) == 2
    finally:
        fxoffload_hf.restore(model)


def test_text_generation_and_feature_extraction_pipelines(llama_dir):
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(1000)}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", pad_token="w0", eos_token="w1")
    text = "w5 w17 w300 w42"
    eager = tf.AutoModelForCausalLM.from_pretrained(llama_dir)
    model = fxoffload_hf.from_pretrained(llama_dir, cpu_memory=1_400_000, device="cpu")
    try:
        expected = tf.pipeline("text-generation", model=eager, tokenizer=tok)(
            text, max_new_tokens=5, do_sample=False
        )
        got = tf.pipeline("text-generation", model=model, tokenizer=tok)(
            text, max_new_tokens=5, do_sample=False
        )
        assert got == expected
    finally:
        fxoffload_hf.restore(model)
    base = fxoffload_hf.AutoModel.from_pretrained(llama_dir, offload="fx", cpu_memory=1_400_000, device="cpu")
    try:
        feats = tf.pipeline("feature-extraction", model=base, tokenizer=tok)
        eager_feats = tf.pipeline(
            "feature-extraction", model=tf.AutoModel.from_pretrained(llama_dir), tokenizer=tok
        )
        assert feats(text) == eager_feats(text)
    finally:
        fxoffload_hf.restore(base)
