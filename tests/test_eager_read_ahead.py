"""Eager calls' read-ahead: the next module's pages faulted in on a thread, within the room the budget leaves."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

import fxoffload_hf
import fxoffload_hf.api
from fxoffload_hf.eager_fallback import EagerWeights
from fxoffload_hf.eager_read_ahead import ReadAhead
from fxoffload_hf.mapped_io import UNIT_BYTES, MappedFiles
from fxoffload_hf.safetensors_io import read_header

MiB = 2**20


@pytest.fixture
def groups(tmp_path):
    """A mapped group of each of two 3 MiB tensors of one file, and their files."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(3 * MiB // 4), "b": torch.randn(3 * MiB // 4)}, path)
    header = read_header(path)
    files = MappedFiles()
    yield files, files.group([header["a"]], [True]), files.group([header["b"]], [True])
    files.close()


def _held_units(files: MappedFiles) -> int:
    return sum(files._held.values())


def test_a_read_ahead_serves_the_call_it_was_made_for(groups):
    files, a, _ = groups
    module, ahead = torch.nn.Linear(1, 1), ReadAhead(files, drop_cache=True)
    ahead.room = None  # no limit
    assert ahead.start(module, a, lent_now=0)
    assert not ahead.wanted()  # one at a time
    assert ahead.take(module, a) and ahead.served == 1
    assert _held_units(files) == len(a.units)  # held for the call, which releases it as its own
    files.release_groups([a], drop_cache=True)
    assert _held_units(files) == 0
    ahead.stop()


def test_a_read_ahead_that_misses_is_let_go(groups):
    files, a, b = groups
    first, second, ahead = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), ReadAhead(files, drop_cache=False)
    ahead.room = None
    assert ahead.start(first, a, lent_now=0)
    assert not ahead.take(second, b)  # another module came: a is let go, b is the caller's to read
    assert _held_units(files) == 0 and ahead.served == 0
    assert ahead.start(first, a, lent_now=0)
    ahead.stop()  # the entry call ended with a read pending
    assert _held_units(files) == 0 and not ahead.wanted()


def test_a_read_ahead_starts_only_within_its_room(groups):
    files, a, _ = groups
    module, ahead = torch.nn.Linear(1, 1), ReadAhead(files, drop_cache=True)
    units = len(set(a.units)) * UNIT_BYTES
    assert not ahead.start(module, a, lent_now=0)  # no room set: outside a deferred call
    ahead.room = 5 * MiB + units
    assert not ahead.start(module, a, lent_now=5 * MiB + 1)
    assert ahead.start(module, a, lent_now=5 * MiB)
    ahead.stop()
    assert _held_units(files) == 0


def test_a_failed_read_ahead_is_let_go_and_left_to_the_call(groups, monkeypatch):
    files, a, _ = groups
    module, ahead = torch.nn.Linear(1, 1), ReadAhead(files, drop_cache=True)
    ahead.room = None

    def fails(ranges):
        raise OSError(5, "read failed")

    monkeypatch.setattr(files, "_fault", fails)
    assert ahead.start(module, a, lent_now=0)
    assert not ahead.take(module, a)  # the call reads (and raises) itself
    assert _held_units(files) == 0
    ahead.stop()


def test_eager_decode_under_a_memory_limit_reads_the_next_module_ahead_exactly(
    tmp_path, save_checkpoint, default_capture, monkeypatch
):
    # under a memory limit pages are dropped after use, and the kernel's read-ahead is not used: the
    # hooks fault the next module's pages in on a thread where the budget leaves room for them (here
    # beside the small layers' modules: the room is sized for the output head)
    monkeypatch.setattr(fxoffload_hf.api, "memory_limit", lambda: 1 << 40)
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    greedy = dict(max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
    budget = sum(p.numel() * p.element_size() for p in eager.parameters()) // 2
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    hooks = next(h for h in engine.memory_holders if isinstance(h, EagerWeights))
    try:
        assert engine.store.drop_cache
        with torch.no_grad():
            assert torch.equal(model.generate(ids, **greedy), expected)
        assert engine.runners == [] and engine.stats.eager_calls == 5
        assert hooks.ahead.served > 0  # decode steps found their modules' pages read ahead
        store = engine.store  # nothing is left held but the weights kept for eager calls
        kept = Counter(unit for r in store.records.values() if r.mapped for unit in store.files.units(r.disk))
        assert store.files._held == kept and not hooks.ahead.wanted()
    finally:
        fxoffload_hf.restore(model)


def test_a_first_eager_call_reads_ahead_in_the_model_order_exactly(
    tmp_path, save_checkpoint, default_capture, monkeypatch
):
    # no call has shown the order modules run in yet: the module declared next is read ahead (layers
    # run in their declared order), so a first call does not wait for each module's pages in turn
    monkeypatch.setattr(fxoffload_hf.api, "memory_limit", lambda: 1 << 40)
    eager = save_checkpoint("llama-vocab-heavy", tmp_path)
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = eager(ids).logits
    # an eighth of the weights: the layers' weights are not kept for eager calls (a half keeps them)
    budget = sum(p.numel() * p.element_size() for p in eager.parameters()) // 8
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=budget, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    hooks = next(h for h in engine.memory_holders if isinstance(h, EagerWeights))
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, expected)
        assert engine.stats.eager_calls == 1
        assert hooks.ahead.served > 0
        assert not hooks.ahead.wanted() and engine.store.files._held == Counter(
            unit
            for r in engine.store.records.values()
            if r.mapped
            for unit in engine.store.files.units(r.disk)
        )
    finally:
        fxoffload_hf.restore(model)
