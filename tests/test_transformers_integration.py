"""from_pretrained(offload="fx") on sharded tiny checkpoints of many architectures, and bad input."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.safetensors_io import CheckpointError

IDS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))


ARCHS = ["llama", "gpt2", "qwen2", "mistral", "opt", "gpt_neox", "bert", "t5", "mixtral"]
# every architecture from the disk tier (cpu_memory); the host tier (gpu_memory: the checkpoint read into
# RAM) loads alike for any architecture: a decoder and an encoder-decoder check it
LOADS = [(arch, "disk") for arch in ARCHS] + [("llama", "host"), ("t5", "host")]


@pytest.mark.parametrize(("arch", "tier"), LOADS, ids=[f"{a}-{t}" for a, t in LOADS])
def test_loaded_model_equals_eager(arch, tier, tmp_path, save_checkpoint, weight_bytes):
    eager = save_checkpoint(arch, tmp_path / "ckpt")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    largest = max(p.numel() * p.element_size() for p in eager.parameters())
    budget = max(int(weight_bytes(eager) * 0.6), int(2.5 * largest) + 300_000)
    kwargs = {"gpu_memory": budget} if tier == "host" else {"cpu_memory": budget}
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", device="cpu", **kwargs)
    try:
        with torch.no_grad():
            if arch == "bert":
                assert torch.equal(model(IDS).last_hidden_state, eager(IDS).last_hidden_state)
            else:
                expected = eager.generate(IDS, max_new_tokens=4, do_sample=False)
                assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), expected)
        engine = fxoffload_hf.engine_of(model)
        assert max(r.program.pieces for r in engine.runners) >= 2
    finally:
        fxoffload_hf.restore(model)


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_checkpoint_files_are_never_modified(llama_ckpt):
    folder, _eager = llama_ckpt
    digest = _digests(folder)
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=1_500_000, device="cpu")
    try:
        with torch.no_grad():
            model.generate(IDS, max_new_tokens=4, do_sample=False)
    finally:
        fxoffload_hf.restore(model)
    assert digest == _digests(folder)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        fxoffload_hf.from_pretrained(tmp_path / "nope")


def test_missing_shard_is_named(llama_ckpt):
    folder, _eager = llama_ckpt
    victim = sorted(folder.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        fxoffload_hf.from_pretrained(folder, cpu_memory=2_000_000, device="cpu")


def test_corrupt_header_is_named(llama_ckpt):
    folder, _eager = llama_ckpt
    victim = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"not json!!!!"
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name}.*corrupt"):
        fxoffload_hf.from_pretrained(folder, cpu_memory=2_000_000, device="cpu")


def test_index_naming_an_absent_tensor_is_named(llama_ckpt):
    folder, _eager = llama_ckpt
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        fxoffload_hf.from_pretrained(folder, cpu_memory=2_000_000, device="cpu")


def test_shape_that_disagrees_with_config_is_named(llama_ckpt):
    folder, _eager = llama_ckpt
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["intermediate_size"] = 512
    config_file.write_text(json.dumps(config))
    with pytest.raises(Exception, match="mlp"):
        fxoffload_hf.from_pretrained(folder, cpu_memory=2_000_000, device="cpu")


def test_pickle_checkpoints_are_refused_unless_allowed(tmp_path, checkpoint_config):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(checkpoint_config("llama")).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu")
    loaded = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu", allow_pickle=True)
    try:
        with torch.no_grad():
            assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    finally:
        fxoffload_hf.restore(loaded)


def test_hub_id_without_network_or_cache_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="download it first"):
        fxoffload_hf.from_pretrained("some-org/some-model-7b", cpu_memory="1GiB")


def test_offload_values_other_than_fx_are_refused(tmp_path):
    with pytest.raises(ValueError, match="offload='fx'"):
        fxoffload_hf.AutoModelForCausalLM.from_pretrained(tmp_path, offload="disk")


def test_plain_shim_behaves_like_hugging_face(llama_ckpt):
    folder, _eager = llama_ckpt
    model = fxoffload_hf.AutoModelForCausalLM.from_pretrained(folder)
    assert not hasattr(model, "_fxoffload_state")
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_max_memory_sets_the_budget_with_hugging_face_meaning(llama_ckpt):
    folder, eager = llama_ckpt
    with pytest.raises(ValueError, match="too small"):
        fxoffload_hf.from_pretrained(folder, max_memory={"cpu": "3KiB"})
    model = fxoffload_hf.from_pretrained(folder, max_memory={"cpu": 1_500_000}, device_map="auto")
    try:
        engine = fxoffload_hf.engine_of(model)
        assert engine.config.cpu_memory == 1_500_000 and engine.config.device.type == "cpu"
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, eager(IDS).logits)
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quantization_config": {"load_in_8bit": True}}, "cannot honour quantization_config="),
        ({"device_map": "cpu"}, "device_map='cpu' cannot be combined"),
        ({"not_a_config_field": 1}, "not_a_config_field"),
    ],
)
def test_keywords_that_cannot_be_honoured_are_refused_before_a_weight_is_read(llama_ckpt, kwargs, message):
    folder, _eager = llama_ckpt
    with pytest.raises((ValueError, TypeError), match=message):
        fxoffload_hf.from_pretrained(folder, cpu_memory="1GiB", **kwargs)


def test_offload_options_without_offload_are_refused_not_dropped(llama_ckpt):
    folder, _eager = llama_ckpt
    with pytest.raises(ValueError, match="cpu_memory only applies with offload='fx'"):
        fxoffload_hf.from_pretrained(folder, offload=None, cpu_memory="1GiB")


def test_a_vocabulary_larger_than_the_budget_streams_in_tiles_and_exactly(tmp_path):
    """vocab 8,000 against hidden 128: each table takes 40% of the weights, and the budget is 60% of one
    table. The embedding table is read by rows from its mapped pages and never counts whole; lm_head
    streams in tiles of rows (``tiles``) instead of being refused, and the output is eager's."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=8000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    eager = tf.LlamaForCausalLM(config).eval()
    eager.save_pretrained(tmp_path / "ckpt")
    table = 8000 * 128 * 4
    ids = torch.randint(0, 8000, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    budget = int(0.6 * table)
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", cpu_memory=budget, device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits)
            options = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False}
            assert torch.equal(model.generate(ids, **options), eager.generate(ids, **options))
        engine = fxoffload_hf.engine_of(model)
        tiles = [r for r in engine.store.records.values() if r.tile_of == "lm_head.weight"]
        assert tiles and all(r.nbytes < table // 2 for r in tiles)
        assert engine.plan is not None and engine.plan.in_flight_bytes <= budget
    finally:
        fxoffload_hf.restore(model)


def test_parameters_the_checkpoint_lacks_are_made_as_transformers_makes_them(tmp_path):
    """Marian does not save its sinusoidal position tables: transformers computes them at load, before
    accelerate's disk hooks move every parameter to meta. They come back with their computed values."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MarianConfig(
        vocab_size=1000, d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=64,
        pad_token_id=0, decoder_start_token_id=0,
    )  # fmt: skip
    tf.MarianMTModel(config).save_pretrained(tmp_path / "ckpt", max_shard_size="300KB")
    assert not any("embed_positions" in key for key in _saved_keys(tmp_path / "ckpt"))
    eager = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ckpt").eval()
    decoder_ids = torch.randint(3, 1000, (1, 5), generator=torch.Generator().manual_seed(4))
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", cpu_memory=2_000_000, device="cpu")
    try:
        with torch.no_grad():
            expected = eager(input_ids=IDS, decoder_input_ids=decoder_ids).logits
            assert torch.equal(model(input_ids=IDS, decoder_input_ids=decoder_ids).logits, expected)
        assert max(r.program.pieces for r in fxoffload_hf.engine_of(model).runners) >= 2
    finally:
        fxoffload_hf.restore(model)


def _saved_keys(folder) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            keys.update(handle.keys())
    return keys


@pytest.mark.parametrize("remainder", [0, 8])
def test_weights_at_any_file_alignment_give_the_eager_tokens_one_by_one(
    remainder, tmp_path, save_checkpoint, weight_bytes, place_data_at
):
    # ATen's matrix-vector product (one token) rounds differently for an operand not aligned to 16
    # bytes: a weight at such an offset is read into the aligned arena instead of used in place
    eager = save_checkpoint("llama", tmp_path / "ckpt")
    place_data_at(tmp_path / "ckpt", remainder)
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", cpu_memory=weight_bytes(eager) // 3, device="cpu")
    try:
        store = fxoffload_hf.engine_of(model).store
        assert all(r.in_place == (remainder == 0) for r in store.weights())
        greedy = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
        with torch.no_grad():
            got, expected = model.generate(IDS, **greedy), eager.generate(IDS, **greedy)
        assert torch.equal(got.sequences, expected.sequences)
        assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores, strict=True))
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.usefixtures("default_capture")
def test_bf16_parameters_a_module_makes_in_fp32_load_in_fp32_as_hugging_face_loads_them(
    tmp_path, checkpoint_config
):
    # OLMo-Hybrid's Gated DeltaNet layers make A_log in fp32 whatever the dtype asked; Hugging Face keeps
    # it so when it loads in bf16, and eager calls reading it in bf16 gave other logits (0.05 off)
    import transformers as tf

    torch.manual_seed(0)
    config = checkpoint_config("olmo_hybrid")
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    eager = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in eager.parameters())
    ids = torch.randint(3, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    model = fxoffload_hf.from_pretrained(tmp_path, offload="fx", cpu_memory=weights, dtype=torch.bfloat16)
    try:
        kept = {n: p.dtype for n, p in eager.named_parameters() if p.dtype != torch.bfloat16}
        assert kept and all("A_log" in n for n in kept)
        assert {n: p.dtype for n, p in model.named_parameters() if n in kept} == kept
        with torch.no_grad():
            assert torch.equal(model(ids).logits, eager(ids).logits)
    finally:
        fxoffload_hf.restore(model)
