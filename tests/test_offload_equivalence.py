"""Offloaded runs equal eager runs, bit for bit in fp32 on the CPU, on the host and disk tiers."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.loaders import InlineReader, LoadSpec
from fxoffload_hf.weight_record import Tier

KINDS = ["llama", "gpt2", "bert", "mlp"]


def _output(model, x):
    out = model(x)
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _tier_budget(kind: str, tier: str, total: int) -> dict:
    # small enough for at least 4 pieces; the disk tier keeps well under the model in RAM
    if tier == "host":
        return {"gpu_memory": int(total * 0.5), "device": "cpu"}
    return {"cpu_memory": int(total * 0.5), "device": "cpu", "policy": "sequential"}


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("kind", KINDS)
def test_offloaded_forward_equals_eager(kind, tier, tmp_path, build_model, example_input, weight_bytes):
    model = build_model(kind)
    x = example_input(kind)
    with torch.no_grad():
        expected = _output(model, x)
    fxoffload_hf.offload(model, offload_folder=tmp_path, **_tier_budget(kind, tier, weight_bytes(model)))
    try:
        with torch.no_grad():
            first = _output(model, x)
            second = _output(model, x)
        engine = fxoffload_hf.engine_of(model)
        assert max(r.program.pieces for r in engine.runners) >= 4
        if tier == "disk":
            assert engine.store.bytes_in(Tier.DISK) > 0
            assert engine.stats.bytes_streamed > 0
        assert torch.equal(first, expected)
        assert torch.equal(second, expected)
    finally:
        fxoffload_hf.restore(model)


# each tier for every kind is checked above (the same loads serve every graph); generate adds the prefill
# and decode graphs, which any tier runs alike: one tier per kind
@pytest.mark.parametrize(("kind", "tier"), [("llama", "disk"), ("gpt2", "host")])
def test_greedy_generate_gives_eager_tokens(kind, tier, tmp_path, build_model, example_input, weight_bytes):
    model = build_model(kind)
    ids = example_input(kind)[:1]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model.generate(
            ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
        )
    fxoffload_hf.offload(model, offload_folder=tmp_path, **_tier_budget(kind, tier, weight_bytes(model)))
    try:
        with torch.no_grad():
            tokens = model.generate(
                ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0
            )
        assert torch.equal(tokens, expected)
    finally:
        fxoffload_hf.restore(model)


def test_restore_puts_back_parameters_and_forward(tmp_path, build_model, example_input, weight_bytes):
    model = build_model("llama")
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    had_forward = "forward" in model.__dict__
    fxoffload_hf.offload(
        model, cpu_memory=int(weight_bytes(model) * 0.6), offload_folder=tmp_path, device="cpu"
    )
    with torch.no_grad():
        model(example_input("llama"))
    fxoffload_hf.restore(model)
    assert ("forward" in model.__dict__) == had_forward
    for name, param in model.named_parameters():
        original, values = before[name]
        assert param is original
        assert torch.equal(param, values)
    assert list(tmp_path.iterdir()) == []


def test_tied_weights_are_stored_once(build_model, example_input, weight_bytes):
    model = build_model("llama", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x = example_input("llama")
    with torch.no_grad():
        expected = model(x).logits
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.6), device="cpu")
    try:
        store = fxoffload_hf.engine_of(model).store
        tied = [r for r in store.records.values() if r.aliases]
        assert len(tied) == 1 and tied[0].shape == (1000, 128)
        assert store.total_bytes == sum(
            p.numel() * 4 for p in model.parameters() if p.numel() * 4 >= 64 * 1024
        )
        with torch.no_grad():
            assert torch.equal(model(x).logits, expected)
    finally:
        fxoffload_hf.restore(model)


def test_calling_an_offloaded_submodule_directly_gives_the_eager_result(build_model, weight_bytes):
    model = build_model("llama")
    eager = build_model("llama")
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.6), device="cpu")
    hidden = torch.randn(1, 128, generator=torch.Generator().manual_seed(0))
    try:
        with pytest.warns(UserWarning, match="'lm_head' ran outside a captured graph"):
            assert torch.equal(model.lm_head(hidden), eager.lm_head(hidden))
    finally:
        fxoffload_hf.restore(model)


def test_graph_breaks_are_offloaded_too():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(256, 256)
            self.b = torch.nn.Linear(256, 256)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    torch.manual_seed(0)
    model = Broken().eval()
    x = torch.randn(3, 256)
    with torch.no_grad():
        expected = model(x)
    fxoffload_hf.offload(model, gpu_memory=700_000, device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        assert len(fxoffload_hf.engine_of(model).runners) == 2
    finally:
        fxoffload_hf.restore(model)


def test_budget_too_small_names_the_weight_and_the_smallest_budget(build_model):
    model = build_model("llama")
    with pytest.raises(ValueError, match=r"too small.*pass gpu_memory=\d+"):
        fxoffload_hf.offload(model, gpu_memory=200_000, device="cpu")
    with pytest.raises(ValueError, match="not offloaded"):  # nothing half-offloaded
        fxoffload_hf.engine_of(model)
    assert all(p.stride()[-1] == 1 and not p.isnan().any() for p in model.parameters())


def test_wrong_device_is_refused(build_model):
    model = build_model("mlp")
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="CUDA is not available"):
        fxoffload_hf.offload(model, device="cuda")


def test_model_to_dtype_after_offload_converts_the_stored_weights(build_model, example_input, weight_bytes):
    eager = build_model("llama")
    model = build_model("llama")
    x = example_input("llama")
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu")
    try:
        model.to(torch.bfloat16)
        ghost = model.lm_head.weight
        assert ghost.dtype == torch.bfloat16 and ghost.untyped_storage().nbytes() == 2  # still a ghost
        with torch.no_grad():
            assert torch.equal(model(x).logits, eager.to(torch.bfloat16)(x).logits)
    finally:
        fxoffload_hf.restore(model)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_moving_an_offloaded_model_to_another_device_is_refused(build_model):
    model = build_model("mlp")
    fxoffload_hf.offload(model, gpu_memory=700_000, device="cpu")
    try:
        with pytest.raises(ValueError, match="restore"):
            model.to("meta")
        with pytest.raises(RuntimeError, match="load_state_dict"):
            model.load_state_dict(build_model("mlp").state_dict())
    finally:
        fxoffload_hf.restore(model)


@pytest.fixture
def profiled_llama_on_disk(tmp_path, build_model, example_input, weight_bytes):
    """A tiny Llama offloaded to the disk tier after its profiled call: (model, input, eager output)."""
    model = build_model("llama")
    x = example_input("llama")
    with torch.no_grad():
        expected = _output(model, x)
    fxoffload_hf.offload(model, offload_folder=tmp_path, **_tier_budget("llama", "disk", weight_bytes(model)))
    try:
        with torch.no_grad():
            assert torch.equal(_output(model, x), expected)
        yield model, x, expected
    finally:
        fxoffload_hf.restore(model)


class _SubmitLog:
    """A reader that logs each load as the runner submits it (on the calling thread), then runs it."""

    def __init__(self, reader, events: list[tuple[str, frozenset[str]]]) -> None:
        self.reader, self.events = reader, events
        self.threads: set[int] = set()

    def submit(self, fn, spec):
        if not isinstance(spec, LoadSpec):  # the unmapping at the end of the call
            return self.reader.submit(fn, spec)
        names = frozenset(r.name for r in (*spec.held, *spec.mapped, *spec.staged, *spec.copied))
        self.events.append(("load", names))
        return self.reader.submit(self._run, fn, spec)

    def _run(self, fn, spec):
        self.threads.add(threading.get_ident())
        return fn(spec)


def _run_with_spies(model, x, schedule):
    """One call under ``schedule``, its loads and releases logged: (output, events, reader spy)."""
    engine = fxoffload_hf.engine_of(model)
    (runner,) = engine.runners
    events: list[tuple[str, frozenset[str]]] = []
    spy = _SubmitLog(schedule.reader, events)
    runner.schedule = replace(schedule, reader=spy)
    release = engine.loader.release

    def spy_release(loaded):
        events.append(("done", frozenset(loaded.tensors)))
        return release(loaded)

    engine.loader.release = spy_release
    engine.called = lambda runner: None  # keep this schedule for the call
    return _output(model, x), events, spy


@pytest.mark.parametrize("distance", [1, 3])
def test_loading_several_pieces_ahead_keeps_eager_results(distance, profiled_llama_on_disk):
    model, x, expected = profiled_llama_on_disk
    with torch.no_grad():
        engine = fxoffload_hf.engine_of(model)
        piece_names = engine.runners[0].program.piece_names
        piece_of = {frozenset(names): i for i, names in enumerate(piece_names)}
        assert len(piece_of) == len(piece_names), "pieces must be told apart by their weights"
        # loads through the read-ahead thread, as when copies cost
        schedule = replace(engine.plan.graphs[0].ahead, distance=distance)
        output, events, _spy = _run_with_spies(model, x, schedule)
        assert torch.equal(output, expected)
        pieces = len(piece_names)
        assert pieces >= 4
        assert [piece_of[names] for kind, names in events if kind == "load"] == list(range(pieces))
        for position, (kind, names) in enumerate(events):
            if kind == "done":
                loads_before = sum(1 for k, _ in events[:position] if k == "load")
                assert loads_before == min(piece_of[names] + 1 + distance, pieces), (names, events)


def test_inline_loads_bring_consecutive_pieces_in_together_within_the_room(profiled_llama_on_disk):
    model, x, expected = profiled_llama_on_disk
    with torch.no_grad():
        engine = fxoffload_hf.engine_of(model)
        inline = engine.plan.graphs[0].inline
        assert engine.loader.arena.capacity == 0 and inline is not None
        assert isinstance(inline.reader, InlineReader) and inline.distance == 0
        output, events, spy = _run_with_spies(model, x, inline)
        assert torch.equal(output, expected)
        assert spy.threads == {threading.get_ident()}, "loads were expected on the calling thread"
        loads = [names for kind, names in events if kind == "load"]
        records = engine.store.records
        pieces = [set(names) for names in engine.runners[0].program.piece_names]
        assert len(pieces) >= 4 and 1 <= len(loads) < len(pieces)
        # the loads cover the pieces in order, each piece whole in one load
        covered = 0
        for names in loads:
            group = set()
            while covered < len(pieces) and pieces[covered] <= names:
                group |= pieces[covered]
                covered += 1
            assert group == names, "a load is not a run of whole consecutive pieces"
            # the embedding table is read by rows from its mapped pages: it is never in flight whole
            whole = [n for n in names if records[n].resident is None and n != "model.embed_tokens.weight"]
            assert sum(records[n].nbytes for n in whole) <= engine.plan.in_flight_bytes
        assert covered == len(pieces)
