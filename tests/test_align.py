"""``fxoffload-hf align``: a checkpoint copied with its data aligned, so that a CPU run uses it in place."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import fxoffload_hf
from fxoffload_hf import align
from fxoffload_hf.align import align_checkpoint
from fxoffload_hf.cli import EXIT_BAD_INPUT, EXIT_OK, main
from fxoffload_hf.safetensors_io import CheckpointError, read_header

IDS = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))


@pytest.fixture
def misaligned(tmp_path, save_checkpoint, place_data_at):
    """A tiny Llama checkpoint whose tensors all start 8 bytes off a multiple of 16, and its eager model."""
    eager = save_checkpoint("llama", tmp_path / "ckpt")
    place_data_at(tmp_path / "ckpt", 8)
    return tmp_path / "ckpt", eager


def _in_place_share(folder):
    model = fxoffload_hf.from_pretrained(folder, cpu_memory="1MiB", device="cpu")
    try:
        store = fxoffload_hf.engine_of(model).store
        with torch.no_grad():
            logits = model(IDS).logits
        return sum(r.in_place for r in store.weights()) / len(store.weights()), logits
    finally:
        fxoffload_hf.restore(model)


def test_aligned_copy_is_used_in_place_with_the_same_values(misaligned, tmp_path, monkeypatch):
    folder, eager = misaligned
    said: list[tuple[object, ...]] = []
    monkeypatch.setattr(align, "warn", lambda *args: said.append(args))
    before, logits_before = _in_place_share(folder)
    assert before == 0 and len(said) == 1 and "fxoffload-hf align" in said[0][0]

    out = align_checkpoint(folder, tmp_path / "aligned")
    shards = sorted(out.glob("*.safetensors"))
    assert [p.name for p in shards] == [p.name for p in sorted(folder.glob("*.safetensors"))]
    assert {p.name for p in out.iterdir()} == {p.name for p in folder.iterdir()}  # config, index too
    for shard in shards:
        offsets = [s.offset for s in read_header(shard).values()]
        assert min(offsets) % align.DATA_ALIGN == 0 and all(o % 16 == 0 for o in offsets)
        original = load_file(folder / shard.name)
        assert all(torch.equal(t, original[k]) for k, t in load_file(shard).items())
    said.clear()
    after, logits_after = _in_place_share(out)
    assert after == 1 and said == []
    with torch.no_grad():
        expected = eager(IDS).logits
    assert torch.equal(logits_before, expected) and torch.equal(logits_after, expected)


def test_align_refuses_bad_input_and_leaves_nothing(misaligned, tmp_path):
    folder, _ = misaligned
    with pytest.raises(FileNotFoundError, match="no safetensors files"):
        align_checkpoint(tmp_path / "nope", tmp_path / "out")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        align_checkpoint(folder, tmp_path / "taken")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated: the header names more bytes than there are
    with pytest.raises(CheckpointError):
        align_checkpoint(folder, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "taken"]


def test_align_command(misaligned, tmp_path, capsys):
    folder, _ = misaligned
    assert main(["align", str(folder), str(tmp_path / "aligned")]) == EXIT_OK
    assert "aligned copy" in capsys.readouterr().out
    assert main(["align", str(folder), str(tmp_path / "aligned")]) == EXIT_BAD_INPUT
    assert "exists" in capsys.readouterr().err


def test_checkpoints_this_library_builds_are_aligned(tmp_path):
    import transformers as tf

    from fxoffload_hf.demo import save_random_checkpoint

    config = tf.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    save_random_checkpoint(config, tmp_path / "built", shard_size="100KB")
    shards = sorted((tmp_path / "built").glob("*.safetensors"))
    assert len(shards) > 1 and not list((tmp_path / "built").glob(".*"))  # no partial file left
    for shard in shards:
        offsets = [s.offset for s in read_header(shard).values()]
        assert min(offsets) % align.DATA_ALIGN == 0 and all(o % 16 == 0 for o in offsets)
