"""from_pretrained(offload="fx") on sharded tiny checkpoints of many architectures, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.safetensors_io import CheckpointError

IDS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))


def _config(arch: str):
    import transformers as tf

    small = dict(
        num_hidden_layers=3, num_attention_heads=4, hidden_size=128, intermediate_size=256, vocab_size=1000
    )
    if arch == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **small)
    if arch == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, **small)
    if arch == "mistral":
        return tf.MistralConfig(num_key_value_heads=2, **small)
    if arch == "mixtral":
        return tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small)
    if arch == "opt":
        return tf.OPTConfig(
            num_hidden_layers=3, num_attention_heads=4, hidden_size=128, ffn_dim=256, vocab_size=1000,
            word_embed_proj_dim=128,
        )  # fmt: skip
    if arch == "gpt_neox":
        return tf.GPTNeoXConfig(**small)
    if arch == "gpt2":
        return tf.GPT2Config(n_layer=3, n_head=4, n_embd=128, vocab_size=1000)
    if arch == "bert":
        return tf.BertConfig(**small)
    if arch == "t5":
        return tf.T5Config(
            vocab_size=1000,
            d_model=128,
            d_ff=256,
            num_layers=2,
            num_heads=4,
            d_kv=32,
            decoder_start_token_id=0,
        )
    raise ValueError(arch)


def save_checkpoint(arch: str, folder: Path) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    config = _config(arch)
    if arch == "bert":
        model = tf.BertModel(config)
    elif arch == "t5":
        model = tf.T5ForConditionalGeneration(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    model.eval().save_pretrained(folder, max_shard_size="300KB")
    return model


def _weights(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize(
    "arch", ["llama", "gpt2", "qwen2", "mistral", "opt", "gpt_neox", "bert", "t5", "mixtral"]
)
def test_loaded_model_equals_eager(arch, tier, tmp_path):
    eager = save_checkpoint(arch, tmp_path / "ckpt")
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) > 1
    largest = max(p.numel() * p.element_size() for p in eager.parameters())
    budget = max(int(_weights(eager) * 0.6), int(2.5 * largest) + 300_000)
    kwargs = {"gpu_memory": budget} if tier == "host" else {"cpu_memory": budget}
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", device="cpu", **kwargs)
    with torch.no_grad():
        if arch == "bert":
            assert torch.equal(model(IDS).last_hidden_state, eager(IDS).last_hidden_state)
        else:
            expected = eager.generate(IDS, max_new_tokens=4, do_sample=False)
            assert torch.equal(model.generate(IDS, max_new_tokens=4, do_sample=False), expected)
    engine = fxoffload_hf.engine_of(model)
    assert max(len(e.piece_bytes) for e in engine.executors) >= 2
    fxoffload_hf.restore(model)


def test_checkpoint_files_are_never_modified(tmp_path):
    import hashlib

    save_checkpoint("llama", tmp_path)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=1_500_000, device="cpu")
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=4, do_sample=False)
    fxoffload_hf.restore(model)
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        fxoffload_hf.from_pretrained(tmp_path / "nope")


def test_missing_shard_is_named(tmp_path):
    save_checkpoint("llama", tmp_path)
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu")


def test_corrupt_header_is_named(tmp_path):
    save_checkpoint("llama", tmp_path)
    victim = sorted(tmp_path.glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[8:20] = b"not json!!!!"
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{victim.name}.*corrupt"):
        fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu")


def test_index_naming_an_absent_tensor_is_named(tmp_path):
    save_checkpoint("llama", tmp_path)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu")


def test_shape_that_disagrees_with_config_is_named(tmp_path):
    save_checkpoint("llama", tmp_path)
    config_file = tmp_path / "config.json"
    config = json.loads(config_file.read_text())
    config["intermediate_size"] = 512
    config_file.write_text(json.dumps(config))
    with pytest.raises(Exception, match="mlp"):
        fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu")


def test_pickle_checkpoints_are_refused_unless_allowed(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(_config("llama")).eval()
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="allow_pickle=True"):
        fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu")
    loaded = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=2_000_000, device="cpu", allow_pickle=True)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
    fxoffload_hf.restore(loaded)


def test_hub_id_without_network_or_cache_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="download it first"):
        fxoffload_hf.from_pretrained("some-org/some-model-7b", cpu_memory="1GiB")


def test_offload_values_other_than_fx_are_refused(tmp_path):
    with pytest.raises(ValueError, match="offload='fx'"):
        fxoffload_hf.AutoModelForCausalLM.from_pretrained(tmp_path, offload="disk")


def test_plain_shim_behaves_like_hugging_face(tmp_path):
    save_checkpoint("llama", tmp_path)
    model = fxoffload_hf.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not hasattr(model, "_fxoffload_state")
    assert all(p.device.type == "cpu" for p in model.parameters())
