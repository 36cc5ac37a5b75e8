"""Batched generate() through an offloaded model: a left-padded batch of prompts of different lengths
gives, per sequence, the tokens and the scores eager gives for the same batch, bit for bit; so do
text-generation pipelines with ``batch_size``, and batch sizes that change between calls."""

from __future__ import annotations

import shutil

import pytest
import torch

import fxoffload_hf

LENGTHS = (3, 9, 6, 12)
PAD = 0
GREEDY = dict(
    max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=PAD
)
# Budgets that cut each model into several pieces and leave most weights on disk: about 45% of the
# weights. Less is refused: the output head (500 KiB, a third of that) streams alone beside a batch's
# activations and the small tensors kept resident.
BUDGETS = {"llama": 1_300_000, "qwen2": 1_300_000, "gpt2": 1_500_000, "mixtral": 2_700_000}


def left_padded(lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random prompts of ``lengths`` tokens, padded on the left, and its attention mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(2, 1000, (length,), generator=gen)
        mask[row, width - length :] = 1
    return ids, mask


def assert_same_generation(got, expected) -> None:
    """The same tokens, and the same score for every step, bit for bit."""
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for step, (score, eager_score) in enumerate(zip(got.scores, expected.scores, strict=True)):
        assert torch.equal(score, eager_score), f"step {step}: {(score - eager_score).abs().max()}"


@pytest.fixture(scope="module")
def checkpoints(llama_master, save_checkpoint, tmp_path_factory):
    """``checkpoints(arch)``: a folder holding this module's tiny ``arch`` checkpoint, and its eager
    model (saved once per module)."""
    root = tmp_path_factory.mktemp("batched")
    made = {}

    def get(arch: str):
        if arch not in made:
            folder = root / arch
            if arch == "llama":
                shutil.copytree(llama_master[0], folder)
                made[arch] = folder, llama_master[1]
            else:
                made[arch] = folder, save_checkpoint(arch, folder)
        return made[arch]

    return get


def _load(folder, arch):
    return fxoffload_hf.from_pretrained(folder, cpu_memory=BUDGETS[arch], device="cpu")


# Llama: in the test of batch sizes that change between calls below
@pytest.mark.parametrize("arch", ["qwen2", "gpt2", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_left_padded_batch_generates_the_eager_tokens_and_scores(checkpoints, arch):
    folder, eager = checkpoints(arch)
    ids, mask = left_padded(LENGTHS, seed=len(arch))
    with torch.no_grad():
        expected = eager.generate(ids, attention_mask=mask, **GREEDY)
    model = _load(folder, arch)
    try:
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, **GREEDY)
        engine = fxoffload_hf.engine_of(model)
        assert all(runner.program.pieces > 1 for runner in engine.runners)
        assert engine.stats.bytes_streamed > 0
    finally:
        fxoffload_hf.restore(model)
    assert_same_generation(got, expected)


def test_batch_sizes_that_change_between_calls_stay_exact(checkpoints):
    folder, eager = checkpoints("llama")
    model = _load(folder, "llama")
    try:
        for seed, lengths in enumerate([(7,), LENGTHS, (10, 4)]):
            ids, mask = left_padded(lengths, seed)
            with torch.no_grad():
                got = model.generate(ids, attention_mask=mask, **GREEDY)
                expected = eager.generate(ids, attention_mask=mask, **GREEDY)
            assert_same_generation(got, expected)
        engine = fxoffload_hf.engine_of(model)
        assert all(runner.program.pieces > 1 for runner in engine.runners)
    finally:
        fxoffload_hf.restore(model)


def _word_tokenizer():
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(1000)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="w0", pad_token="w0", eos_token="w1", padding_side="left"
    )


def test_text_generation_pipeline_with_batch_size_gives_the_eager_texts(checkpoints):
    import transformers as tf

    folder, eager = checkpoints("qwen2")
    tok = _word_tokenizer()
    gen = torch.Generator().manual_seed(11)
    prompts = [" ".join(f"w{int(i)}" for i in torch.randint(2, 1000, (n,), generator=gen)) for n in LENGTHS]
    # two batches of two prompts, each padded to its own longest
    options = dict(max_new_tokens=6, do_sample=False, batch_size=2, return_full_text=False)
    expected = tf.pipeline("text-generation", model=eager, tokenizer=tok)(prompts, **options)
    model = _load(folder, "qwen2")
    try:
        got = tf.pipeline("text-generation", model=model, tokenizer=tok)(prompts, **options)
    finally:
        fxoffload_hf.restore(model)
    assert got == expected
    assert all(text[0]["generated_text"] for text in got)


def test_a_batch_whose_activations_do_not_fit_is_refused_at_capture(checkpoints):
    folder, _ = checkpoints("llama")
    ids, mask = left_padded((40,) * 23 + (20,), seed=5)
    model = _load(folder, "llama")
    try:
        with (
            torch.no_grad(),
            pytest.raises(
                fxoffload_hf.BudgetTooSmallError,
                match=r"of activations.*pass cpu_memory=\d+ or more, or call it with a smaller batch",
            ) as info,
        ):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
    finally:
        fxoffload_hf.restore(model)
    assert info.value.smallest_budget > BUDGETS["llama"]


@pytest.mark.slow
def test_a_later_batch_whose_activations_do_not_fit_is_refused(checkpoints):
    folder, _ = checkpoints("llama")
    model = _load(folder, "llama")
    try:
        with torch.no_grad():
            # batches of 3 and 24: a size equal to one of the model's (2 key/value heads, a head dimension
            # of 32) may be specialised by dynamo's duck sizing, get graphs of its own, and be checked
            ids, mask = left_padded((12, 5, 8), seed=6)
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
            ids, mask = left_padded((40,) * 23 + (20,), seed=5)
            try:
                model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=PAD)
            except fxoffload_hf.BudgetTooSmallError:
                return
        raise AssertionError("a batch of 24 ran under a budget its activations (about 5 MiB) do not fit")
    finally:
        fxoffload_hf.restore(model)


def test_a_module_called_directly_on_a_batch_gives_the_eager_values(checkpoints):
    folder, eager = checkpoints("llama")
    last = torch.randn(4, 12, 128, generator=torch.Generator().manual_seed(8))[:, -1:]  # not contiguous
    model = _load(folder, "llama")
    try:
        with torch.no_grad(), pytest.warns(UserWarning, match="ran outside a captured graph"):
            got = model.lm_head(last)
        with torch.no_grad():
            assert torch.equal(got, eager.lm_head(last))
    finally:
        fxoffload_hf.restore(model)
