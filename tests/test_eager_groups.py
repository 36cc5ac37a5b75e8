"""The mapped group each module's eager call is lent, kept per module; a read-ahead guess fails no call."""

from __future__ import annotations

import torch

import fxoffload_hf
from fxoffload_hf.eager_fallback import EagerWeights
from fxoffload_hf.eager_sizes import own_ghosts


def test_a_guess_whose_file_is_gone_reads_nothing_ahead_and_fails_no_call(tmp_path, save_checkpoint):
    save_checkpoint("llama", tmp_path)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="1MiB", device="cpu", capture="deferred")
    engine = fxoffload_hf.engine_of(model)
    hooks = next(h for h in engine.memory_holders if isinstance(h, EagerWeights))
    groups, version = hooks.groups, engine.store.version
    try:
        up, down = model.model.layers[0].mlp.up_proj, model.model.layers[0].mlp.down_proj
        assert groups.ahead(down, version, lambda: []) is None  # nothing lent in place: nothing to read
        assert groups.ahead(down, version, lambda: own_ghosts(up)) is None  # noted until weights move
        shard = engine.store.records["model.layers.0.mlp.up_proj.weight"].disk.path
        moved = shard.rename(shard.with_suffix(".away"))
        try:
            assert groups.ahead(up, version, lambda: own_ghosts(up)) is None  # no error: a guess
        finally:
            moved.rename(shard)
        group = groups.ahead(up, version, lambda: own_ghosts(up))
        assert group is not None and groups.of(up, own_ghosts(up)) is group  # kept for its call
        assert groups.ahead(up, version + 1, lambda: []) is group  # its last call's, whatever moved
        ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.isfinite(model(ids).logits).all()
    finally:
        fxoffload_hf.restore(model)
