"""Eager fallback: modules dynamo leaves to run eagerly, and direct calls, get their weights for the call."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import pytest
import torch
import transformers
from torch import nn

import fxoffload_hf
from fxoffload_hf.capture import handle_of
from fxoffload_hf.eager_fallback import EagerFallbackWarning
from fxoffload_hf.eager_forwards import methods_reading_weights, plain_lookup, reads_rows
from fxoffload_hf.memory_model import BudgetTooSmallError


class Uncapturable(nn.Linear):
    """A projection dynamo never captures (as with a graph break it cannot trace past)."""

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias).relu()


class BreakInside(nn.Module):
    """Reads its own weight on both sides of a graph break."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.weight
        torch._dynamo.graph_break()
        return (x @ self.weight.T).tanh()


class Mixed(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.eager = Uncapturable(width, width)
        self.broken = BreakInside(width)
        self.last = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.broken(self.eager(self.first(x).relu())))


def _ghosts_are_ghosts(model: nn.Module) -> bool:
    ghosts = [p for p in model.parameters() if handle_of(p) is not None]
    return bool(ghosts) and all(p.untyped_storage().nbytes() == p.element_size() for p in ghosts)


def _offloaded_after_eager(model: nn.Module, x: torch.Tensor, weight_bytes) -> torch.Tensor:
    """Eager's output of ``model`` on ``x``; then ``model`` offloaded at 90% of its weights."""
    with torch.no_grad():
        expected = model(x)
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.9), device="cpu")
    return expected


@pytest.fixture
def mixed(weight_bytes):
    torch.manual_seed(0)
    model, x = Mixed().eval(), torch.randn(3, 256)
    expected = _offloaded_after_eager(model, x, weight_bytes)
    yield model, x, expected
    fxoffload_hf.restore(model)


def test_modules_dynamo_does_not_capture_run_exactly_with_one_warning_each(mixed):
    model, x, expected = mixed
    with pytest.warns(EagerFallbackWarning) as caught, torch.no_grad():
        first = model(x)
    assert torch.equal(first, expected)
    named = sorted(str(w.message).split()[1] for w in caught)
    # 'broken' is called past a graph break dynamo cannot resume inside its caller: its forward runs as
    # a frame of its own and is lent its weights (dynamo still captures graphs around its own break)
    assert named == ["'broken'", "'eager'"], [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error", EagerFallbackWarning)  # once per module, not per call
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    assert _ghosts_are_ghosts(model)


def test_a_submodule_called_directly_gets_its_weights_for_the_call_only(mixed):
    model, x, _expected = mixed
    with torch.no_grad():
        model(x)
    restored_values = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.warns(EagerFallbackWarning, match="'last'"), torch.no_grad():
        direct = model.last(x)
    assert _ghosts_are_ghosts(model)
    fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(direct, model.last(x))
    fxoffload_hf.offload(model, gpu_memory=None, device="cpu")  # the fixture restores it again
    assert restored_values.keys() == dict(model.named_parameters()).keys()


def test_an_exception_inside_an_eager_module_gives_the_ghosts_back_and_frees_the_engine(mixed):
    model, x, expected = mixed
    with pytest.warns(EagerFallbackWarning), pytest.raises(RuntimeError, match="mat1 and mat2"):
        model.last(torch.randn(3, 7))
    assert _ghosts_are_ghosts(model)
    lock = fxoffload_hf.engine_of(model).lock
    took = []
    thread = threading.Thread(target=lambda: took.append(lock.acquire(timeout=5)) or lock.release())
    thread.start()
    thread.join()
    assert took == [True]
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_past_the_recompile_limit_the_model_runs_eagerly_and_exactly(monkeypatch, build_model, weight_bytes):
    import fxoffload_hf.capture

    monkeypatch.setattr(fxoffload_hf.capture, "RECOMPILE_LIMIT", 2)
    model = build_model("mlp")
    eager = build_model("mlp")
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu")
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            for rank in range(1, 6):  # each rank is a new graph: from the third on, dynamo gives up
                x = torch.randn(*([2] * (rank - 1)), 256, generator=torch.Generator().manual_seed(rank))
                assert torch.equal(model(x), eager(x)), rank
        assert len(fxoffload_hf.engine_of(model).runners) == 2
        assert any(issubclass(w.category, EagerFallbackWarning) for w in caught)
    finally:
        fxoffload_hf.restore(model)


class RoutedExperts(nn.Module):
    """Mixture-of-experts routing as some Transformers types write it: a loop over the experts hit, with
    ``.item()`` and ``torch.where``; dynamo resumes after the first break, then gives up on the loop."""

    def __init__(self, experts: int = 4, width: int = 64, inner: int = 128) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * inner, width) * 0.05)
        self.down = nn.Parameter(torch.randn(experts, width, inner) * 0.05)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(idx, num_classes=self.gate_up.shape[0]).permute(1, 0)
        for e in (mask.sum(-1) > 0).nonzero():
            e = int(e.item())
            (tok,) = torch.where(mask[e])
            g, u = torch.nn.functional.linear(x[tok], self.gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, tok, torch.nn.functional.linear(torch.nn.functional.silu(g) * u, self.down[e]))
        return out


def test_weights_read_by_eager_code_resumed_inside_a_module_are_its_weights(weight_bytes):
    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router = nn.Linear(64, 4)
            self.experts = RoutedExperts()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.experts(x, self.router(x).argmax(-1))

    torch.manual_seed(0)
    model, x = Routed().eval(), torch.randn(12, 64)
    with torch.no_grad():
        expected = model(x)
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 1.5), device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    finally:
        fxoffload_hf.restore(model)


@contextlib.contextmanager
def _loaded(save_checkpoint, folder, arch: str, cpu_memory: str) -> Iterator[tuple[nn.Module, nn.Module]]:
    """The tiny ``arch`` checkpoint: its eager model, and the same loaded offloaded (restored after)."""
    eager = save_checkpoint(arch, folder)
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=cpu_memory, device="cpu")
    try:
        yield eager, model
    finally:
        fxoffload_hf.restore(model)


@contextlib.contextmanager
def _calling_submodules() -> Iterator[None]:
    """Direct calls of offloaded submodules: eager, on purpose."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore", EagerFallbackWarning)
        yield


def test_a_module_called_directly_reads_its_weights_in_place_from_the_checkpoint(tmp_path, save_checkpoint):
    # on the CPU, eager calls use views of the checkpoint's mapped pages, as the runner's loads do: no
    # copy of the weight is made, and the pages are let go after the call
    with _loaded(save_checkpoint, tmp_path, "llama", "1MiB") as (eager, model):
        mlp, expected_mlp = model.model.layers[1].mlp, eager.model.layers[1].mlp
        seen = []
        mlp.down_proj.register_forward_pre_hook(
            lambda m, _: seen.append(m.weight.untyped_storage().nbytes() > m.weight.nbytes)
        )
        x = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(3))
        with _calling_submodules():
            assert torch.equal(mlp(x), expected_mlp(x))
        assert seen == [True]  # a view into the mapped file, not a tensor of its own
        assert not +fxoffload_hf.engine_of(model).store.files._held  # every page let go
        assert _ghosts_are_ghosts(model)


def test_the_warning_tells_a_table_read_by_rows_from_weights_lent_whole(tmp_path, save_checkpoint):
    """A user's own lookup (``get_input_embeddings()(ids)``, for ``inputs_embeds``) reads rows of the table
    where it lies: the warning says so, and counts nothing lent whole; a projection's call is lent whole."""
    with _loaded(save_checkpoint, tmp_path, "llama", "1MiB") as (eager, model):
        ids = torch.tensor([[5, 7, 900]])
        with pytest.warns(EagerFallbackWarning) as caught, torch.no_grad():
            rows = model.get_input_embeddings()(ids)
            model.model.layers[0].mlp.up_proj(rows)
        assert torch.equal(rows, eager.get_input_embeddings()(ids))
        lookup, projection = (str(w.message) for w in caught)
        assert "(0 B whole; its table (500.00 KiB) read by rows where it lies)" in lookup, lookup
        assert "(128.00 KiB whole)" in projection, projection


def test_eager_calls_read_the_next_modules_pages_ahead_in_the_order_they_ran(tmp_path, save_checkpoint):
    with _loaded(save_checkpoint, tmp_path, "llama", "1MiB") as (_, model):
        engine = fxoffload_hf.engine_of(model)
        mlp = model.model.layers[0].mlp
        asked = []
        engine.store.files.read_ahead = asked.append  # type: ignore[method-assign]
        x = torch.randn(1, 3, 128)
        with _calling_submodules():
            mlp(x)
            first = list(asked)
            asked.clear()
            mlp(x)
        hooks = next(iter(mlp.up_proj._forward_pre_hooks.values())).__self__  # the model's EagerWeights
        groups = hooks.groups._groups
        # a first call reads ahead the module declared next (the MLP declares its projections in the
        # order it calls them); the last one's is the next layer's first, which this call does not run
        assert first[:2] == [groups[mlp.up_proj][1], groups[mlp.down_proj][1]]
        # later calls, the module that followed last time (the last one's successor is the first: the
        # call repeats)
        assert asked == [groups[m][1] for m in (mlp.up_proj, mlp.down_proj, mlp.gate_proj)]


def test_a_module_whose_weights_change_tier_between_eager_calls_is_lent_its_own(tmp_path, save_checkpoint):
    # the experts hold two offloaded weights; keeping one where the model computes, then the other,
    # changes which of them are mapped from the file for each call
    with _loaded(save_checkpoint, tmp_path, "mixtral", "4MiB") as (eager, model):
        store = fxoffload_hf.engine_of(model).store
        moe, expected_moe = model.model.layers[0].mlp, eager.model.layers[0].mlp
        names = [n for n in store.records if n.startswith("model.layers.0.mlp.experts.")]
        assert len(names) == 2
        x = torch.randn(1, 5, 128, generator=torch.Generator().manual_seed(5))
        with _calling_submodules():
            expected = expected_moe(x)
            assert torch.equal(moe(x), expected)
            store.keep(names[0])
            assert torch.equal(moe(x), expected)
            store.evict(names[0])
            store.keep(names[1])
            assert torch.equal(moe(x), expected)


def test_an_interrupt_inside_an_eager_call_gives_back_the_lock_and_the_pages(tmp_path, save_checkpoint):
    save_checkpoint("llama", tmp_path)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="1MiB", device="cpu", capture="deferred")
    engine = fxoffload_hf.engine_of(model)
    try:

        def interrupt(module, args):
            raise KeyboardInterrupt  # torch skips always-call post-hooks for it

        ids = torch.randint(0, 1000, (1, 6), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            model(ids)
        kept = +engine.store.files._held  # the pages of the weights kept for eager calls, no more
        handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt), torch.no_grad():
            model(ids)
        handle.remove()
        assert +engine.store.files._held == kept  # no page lent to the interrupted call left held
        assert _ghosts_are_ghosts(model)
        took = []
        thread = threading.Thread(
            target=lambda: took.append(engine.lock.acquire(timeout=5)) or engine.lock.release()
        )
        thread.start()
        thread.join()
        assert took == [True]
    finally:
        fxoffload_hf.restore(model)


class LoopOverExperts(nn.Module):
    """Experts stacked in one weight, run in a Python loop over the experts a call hits (a data-dependent
    ``nonzero``): dynamo cannot resume inside that loop, so the forward runs for real after dynamo traced
    the module's call and its pre-hook (as in Transformers' OpenAI privacy filter)."""

    def __init__(self, width: int, experts: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width**0.5)

    def forward(self, x: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        hit = torch.bincount(choice, minlength=self.weight.shape[0]).nonzero()
        for expert in hit:
            rows = torch.where(choice == expert[0])[0]
            out[rows] = x[rows] @ self.weight[expert[0]]
        return out


class Routed(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.router = nn.Linear(width, 4)
        self.experts = LoopOverExperts(width)
        self.last = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.experts(x, self.router(x).argmax(-1)))


def test_a_forward_that_runs_for_real_after_its_call_was_traced_gets_its_weights(weight_bytes):
    torch.manual_seed(0)
    model, x = Routed().eval(), torch.randn(16, 128)
    expected = _offloaded_after_eager(model, x, weight_bytes)
    try:
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            got = [model(x), model(x)]
        assert all(torch.equal(out, expected) for out in got)  # not NaN: the ghosts were lent
        assert any(
            issubclass(w.category, EagerFallbackWarning) and "experts" in str(w.message) for w in caught
        )
        assert _ghosts_are_ghosts(model)
    finally:
        fxoffload_hf.restore(model)


def test_an_eager_call_whose_weights_cannot_fit_whole_is_refused_naming_the_module(weight_bytes):
    """A module dynamo leaves to run eagerly is lent its weights whole: where they exceed the budget, the
    call is refused by name (the budget to pass in the message), not run beyond it."""
    torch.manual_seed(0)
    model, x = Mixed().eval(), torch.randn(3, 256)
    one_module = 256 * 256 * 4 + 256 * 4  # 'eager': its weight and bias
    fxoffload_hf.offload(model, cpu_memory=one_module // 2, device="cpu")
    try:
        with pytest.raises(BudgetTooSmallError, match=r"Uncapturable 'eager' runs outside a captured graph"):
            model(x)
        assert _ghosts_are_ghosts(model)
    finally:
        fxoffload_hf.restore(model)


class _ScaledEmbedding(nn.Embedding):  # Transformers' scaled word embeddings, in short
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * 2.0


class _TableTimesTwo(nn.Embedding):  # computes with the whole table
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight * 2.0)


class _Positions(nn.Embedding):  # a learned positional embedding: its forward takes other arguments
    def forward(self, length: int, offset: int) -> torch.Tensor:
        return super().forward(torch.arange(offset, offset + length))


def test_embeddings_whose_calls_only_look_rows_up_are_lent_their_table_where_it_lies() -> None:
    """A plain ``nn.Embedding`` reads rows of its table (lent where it lies, gathered there on CUDA); on
    the CPU so does one whose forward passes its table to lookups only (run on the lent table); one that
    computes with the whole table, takes other arguments or has a ``max_norm`` (which writes the table)
    is lent its table whole."""
    assert reads_rows(nn.Embedding(10, 4), "cpu") and reads_rows(nn.Embedding(10, 4), "cuda")
    assert plain_lookup(nn.Embedding(10, 4)) and not plain_lookup(_ScaledEmbedding(10, 4))
    assert not reads_rows(nn.Embedding(10, 4, max_norm=1.0), "cpu")
    assert reads_rows(_ScaledEmbedding(10, 4), "cpu")
    assert not reads_rows(_ScaledEmbedding(10, 4), "cuda")  # rows gathered on the host skip its forward
    assert not reads_rows(_TableTimesTwo(10, 4), "cpu")
    assert not reads_rows(_Positions(10, 4), "cpu")
    assert not reads_rows(nn.Linear(4, 4), "cpu")


class _Scale(nn.Module):  # a helper that reads the weight, and one that does not
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scaled(x)

    def scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight

    def shape_of(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(x.shape)

    def extra_repr(self) -> str:  # torch's to call (printing the model): no weights lent for it
        return f"{tuple(self.weight.shape)}"


def test_methods_that_may_read_a_leaf_modules_weights_are_the_ones_named() -> None:
    """A leaf's own methods (not torch's) whose code names ``forward`` or a weight; a module with
    children has none (it is called, or its children are)."""
    from transformers.models.prophetnet.modeling_prophetnet import ProphetNetPositionalEmbeddings

    assert methods_reading_weights(_Scale(), ["weight"]) == ["scaled"]
    assert methods_reading_weights(_Positions(10, 4), ["weight"]) == []  # its forward is not wrapped here
    assert methods_reading_weights(nn.Linear(4, 4), ["weight", "bias"]) == []
    assert methods_reading_weights(nn.Sequential(_Scale()), ["weight"]) == []
    config = transformers.ProphetNetConfig(hidden_size=16, max_position_embeddings=8)
    assert methods_reading_weights(ProphetNetPositionalEmbeddings(config), ["weight"]) == ["_forward"]


def test_a_method_called_instead_of_the_module_gets_its_weights(tmp_path, weight_bytes) -> None:
    """ProphetNet's decoder calls its position embedding's ``_forward`` (``nn.Embedding.forward`` without
    ``__call__``, so no hook runs): called eagerly (deferred capture), it is lent the table as a call
    is, and the logits of every stream equal eager's (its NaN stand-in was read before)."""
    torch.manual_seed(0)
    config = transformers.ProphetNetConfig(
        vocab_size=4000, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4, ngram=2,
        max_position_embeddings=512, is_decoder=True, add_cross_attention=False,
    )  # fmt: skip
    eager = transformers.ProphetNetForCausalLM(config).eval()
    eager.save_pretrained(tmp_path)
    ids = torch.randint(3, 4000, (1, 7), generator=torch.Generator().manual_seed(1))
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=weight_bytes(eager) * 3 // 4, device="cpu",
                                         capture="deferred")  # fmt: skip
    try:
        with torch.no_grad():
            got, expected = model(ids), eager(ids)
            assert fxoffload_hf.engine_of(model).stats.eager_calls == 1  # the call ran eagerly
    finally:
        fxoffload_hf.restore(model)
    # the main stream's logits and the predicting streams' (which use the position embedding's _forward)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.logits_ngram, expected.logits_ngram)


class _RootWithWeight(nn.Module):
    """A model whose own module holds a large weight (no child to call)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1024, 256) / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight.t()).tanh()


@pytest.mark.parametrize("budget", ["512KiB", "8MiB"], ids=["refused", "captured"])
def test_an_entry_points_own_weights_are_not_lent_around_its_captured_call(budget):
    """The entry point's own module is captured: hooks on it would lend its weights whole around the
    captured call, outside it (a second copy, refused at a budget the graph fits), and a refusal named
    an eager call that was not run."""
    torch.manual_seed(0)
    model = _RootWithWeight()
    x = torch.randn(2, 256)
    with torch.no_grad():
        want = model(x)
    fxoffload_hf.offload(model, cpu_memory=budget, device="cpu", capture="first-call")
    try:
        with torch.no_grad():
            if budget == "512KiB":
                with pytest.raises(
                    BudgetTooSmallError, match=r"weight takes 1.00 MiB and must fit whole: its use"
                ):
                    model(x)
            else:
                assert torch.equal(model(x), want)
        engine = fxoffload_hf.engine_of(model)
        assert engine.memory_holders[-1].lends == 0  # nothing lent outside the graph
    finally:
        fxoffload_hf.restore(model)


def test_an_entry_point_run_eagerly_lends_its_own_weights(eager_calls_bounded):
    """Deferred, the entry point runs its own module as eager code and lends it its weights for the call
    (its hooks do not: ``lending_to``)."""
    torch.manual_seed(0)
    model = _RootWithWeight()
    x = torch.randn(2, 256)
    with torch.no_grad():
        want = model(x)
    fxoffload_hf.offload(model, cpu_memory="8MiB", device="cpu", capture="deferred")
    try:
        with torch.no_grad():
            assert torch.equal(model(x), want)
        engine = fxoffload_hf.engine_of(model)
        assert engine.runners == [] and engine.stats.eager_calls == 1
        assert engine.memory_holders[-1].lends == 1 and torch.isnan(model.weight).all()
    finally:
        fxoffload_hf.restore(model)
