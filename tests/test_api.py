"""``offload`` installs in named steps and ``restore`` undoes them, leaving the module as it found it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.api import engine_of
from fxoffload_hf.undo import AttachedHook, PatchedAttribute, StoredParameter, SwappedParameter


def _snapshot(model: torch.nn.Module) -> dict:
    return {
        "params": {n: (p, p.data_ptr(), p.dtype) for n, p in model.named_parameters()},
        "buffers": {n: b for n, b in model.named_buffers()},
        "dicts": {n: set(m.__dict__) for n, m in model.named_modules()},
        "hooks": {
            n: (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._load_state_dict_pre_hooks))
            for n, m in model.named_modules()
        },
    }


def test_restore_undoes_every_install_step_in_reverse(build_model, example_input):
    model = build_model("llama", num_hidden_layers=2)
    x = example_input("llama")
    before = _snapshot(model)
    with torch.no_grad():
        expected = model(x).logits
    fxoffload_hf.offload(model, gpu_memory="1GiB", device="cpu")
    assert engine_of(model).store.records
    undo = model._fxoffload_state.undo
    kinds = {type(u) for u in undo}
    assert {SwappedParameter, StoredParameter, AttachedHook, PatchedAttribute} <= kinds
    # the entry point last, then generate (its KV cache counted before the first token) and the cache
    # it makes (reserved for its final length)
    assert [(type(u), u.attr) for u in undo[-3:]] == [
        (PatchedAttribute, "forward"),
        (PatchedAttribute, "generate"),
        (PatchedAttribute, "_prepare_cache_for_generation"),
    ]
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)
    fxoffload_hf.restore(model)
    assert _snapshot(model) == before and "generate" not in model.__dict__
    assert "_prepare_cache_for_generation" not in model.__dict__
    with torch.no_grad():
        assert torch.equal(model(x).logits, expected)


def test_a_failed_install_leaves_nothing_behind(build_model):
    model = build_model("mlp")
    before = _snapshot(model)
    with pytest.raises(AttributeError):
        fxoffload_hf.offload(model, device="cpu", entry_points=("forward", "no_such_method"))
    assert _snapshot(model) == before
    assert not hasattr(model, "_fxoffload_state")
    fxoffload_hf.offload(model, device="cpu")  # and it can be offloaded again
    fxoffload_hf.restore(model)


def test_an_up_front_refusal_names_the_smallest_budget_and_installs_nothing(build_model):
    model = build_model("mlp")
    before = _snapshot(model)
    with pytest.raises(fxoffload_hf.BudgetTooSmallError, match=r"pass gpu_memory=\d+") as info:
        fxoffload_hf.offload(model, gpu_memory=1024, device="cpu")
    assert info.value.smallest_budget > 1024
    assert _snapshot(model) == before


def test_compile_only_algorithms_are_switched_to_the_eager_ones_and_back(tmp_path):
    """Transformers' Mamba mixers use a parallel scan only under torch.compile (other rounding than the
    eager sequential scan): the offloaded model runs the eager one, and restore puts the switch back."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=1000, state_size=8)
    model = tf.MambaForCausalLM(config).eval()
    ids = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(0))
    mixers = [m for m in model.modules() if hasattr(m, "use_associative_scan")]
    assert mixers and all(m.use_associative_scan for m in mixers) and model.config.use_associative_scan
    with torch.no_grad():
        expected = model(ids).logits
    fxoffload_hf.offload(
        model, gpu_memory=int(sum(p.numel() * 4 for p in model.parameters()) * 1.5), device="cpu"
    )
    try:
        assert not any(m.use_associative_scan for m in mixers) and not model.config.use_associative_scan
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
    finally:
        fxoffload_hf.restore(model)
    assert all(m.use_associative_scan for m in mixers) and model.config.use_associative_scan


# offloads an in-memory model whose weights must go to disk (spilled to a temporary folder of ours) and
# loads a checkpoint (``from_pretrained`` makes a folder for Transformers' own offload), then exits
# without restoring either
_NEVER_RESTORED = """
import json, sys
import fxoffload_hf
from fxoffload_hf.undo import OwnedFolder
sys.path.insert(0, sys.argv[1])
from conftest import MLP

model = fxoffload_hf.offload(MLP().eval(), cpu_memory=600_000, device="cpu")
spilled = fxoffload_hf.engine_of(model).store.spill_folder(None)
loaded = fxoffload_hf.from_pretrained(sys.argv[2], device="cpu")
(owned,) = [u.path for u in loaded._fxoffload_state.undo if isinstance(u, OwnedFolder)]
print(json.dumps({str(f): sorted(p.name for p in f.iterdir()) for f in (spilled, owned)}))
"""


def test_a_process_that_never_restores_its_models_leaves_no_folder_of_ours(llama_ckpt):
    folder, _ = llama_ckpt
    tests = Path(__file__).resolve().parent
    done = subprocess.run(
        [sys.executable, "-c", _NEVER_RESTORED, str(tests), str(folder)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    made = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(made) == 2 and any(made.values()), "nothing was spilled: the check checks nothing"
    assert not [f for f in made if Path(f).exists()], "left behind at exit"
