"""Models that rescale their weights in place at their first call (``weight_rescaling``): RWKV with
``rescale_every``, offloaded at a budget of several pieces, gives eager's logits and tokens bit for bit,
and the weights ``restore`` gives back are those it was offloaded with."""

from __future__ import annotations

import operator

import pytest
import torch
import transformers

import fxoffload_hf
from fxoffload_hf import graphs, weight_rescaling

GREEDY = dict(max_new_tokens=4, do_sample=False)


# four blocks rescaled every one: blocks 1-3 divide their output projections by 2, 4 and 8 (RWKV-4's
# checkpoints: every 6, for fp16)
CONFIG = dict(
    vocab_size=1000, hidden_size=256, num_hidden_layers=4, attention_hidden_size=256, intermediate_size=512,
    rescale_every=1,
)  # fmt: skip


@pytest.mark.parametrize(
    "dtype, capture",
    [(torch.float32, "first-call"), (torch.float16, "first-call"), (torch.float32, "deferred")],
    ids=["fp32-captured", "fp16-captured", "fp32-eager"],
)
def test_rwkv_rescaling_its_layers_gives_eagers_outputs(tmp_path, dtype, capture):
    """Captured (pieces), and as eager calls (RWKV's calls are bounded: ``linear_attention``)."""
    torch.manual_seed(0)
    config = transformers.RwkvConfig(**CONFIG)
    transformers.AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    ids = torch.randint(1, 1000, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, want_tokens = eager(ids).logits, eager.generate(ids, **GREEDY)
    assert eager.rwkv.layers_are_rescaled  # the eager model divided its weights at its first call

    model = fxoffload_hf.from_pretrained(
        tmp_path, dtype=dtype, cpu_memory=3_000_000, device="cpu", capture=capture
    )
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
        assert torch.equal(model.generate(ids, **GREEDY), want_tokens)
        assert torch.equal(model(ids).logits, want)  # a later call too: nothing divided twice
    stats = fxoffload_hf.engine_of(model).stats
    if capture == "deferred":
        assert stats.eager_calls == 6 and stats.runs == 0  # two forwards, a prefill and three steps
    else:
        assert stats.pieces_run > stats.runs  # several pieces per call

    fxoffload_hf.restore(model)


def test_an_offloaded_model_in_memory_is_given_back_as_loaded(tmp_path):
    """Offloaded before its first call, then restored: the weights are the checkpoint's, and its next
    eager call rescales them as eager does; offloaded after one (its weights divided already): equal."""
    config = transformers.RwkvConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=4, attention_hidden_size=256, intermediate_size=512,
        rescale_every=1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    ids = torch.randint(1, 1000, (1, 7), generator=torch.Generator().manual_seed(1))
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        want = eager(ids).logits
    for ran_before in (False, True):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        checkpoint = model.rwkv.blocks[3].attention.output.weight.clone()
        if ran_before:
            with torch.no_grad():
                model(ids)
        fxoffload_hf.offload(model, cpu_memory=3_000_000, device="cpu")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)
        fxoffload_hf.restore(model)
        held = model.rwkv.blocks[3].attention.output.weight
        assert torch.equal(held, checkpoint / 8 if ran_before else checkpoint)
        with torch.no_grad():
            assert torch.equal(model(ids).logits, want)


def test_a_model_writing_into_its_weights_is_refused(tmp_path, monkeypatch):
    """Unhandled (its rescaling left to it), RWKV's captured call writes into a weight: refused, naming the
    weight and the op, before any piece runs."""
    monkeypatch.setattr(weight_rescaling, "_RESCALED", {})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.RwkvConfig(**CONFIG)).save_pretrained(tmp_path)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory=3_000_000, device="cpu")
    with pytest.raises(
        NotImplementedError,
        match=r"writes into its weight rwkv\.blocks\.0\.attention\.output\.weight .* \(`div_`\)",
    ):
        model(torch.tensor([[1, 2, 3]]))
    assert fxoffload_hf.engine_of(model).stats.pieces_run == 0


def test_an_eager_call_writing_into_a_weight_is_refused(tmp_path, save_checkpoint):
    """A deferred (eager) call whose module writes into its lent weight: refused as the module returns,
    naming the weight; the model is left as it was."""
    save_checkpoint("llama", tmp_path)
    model = fxoffload_hf.from_pretrained(tmp_path, cpu_memory="1MiB", device="cpu", capture="deferred")
    projection = model.model.layers[1].mlp.down_proj

    def write(module, _args):
        with torch.no_grad():
            module.weight.mul_(1.0)  # runs after the pre-hook that lends the weight

    handle = projection.register_forward_pre_hook(write)
    ids = torch.randint(0, 1000, (1, 5), generator=torch.Generator().manual_seed(0))
    with (
        torch.no_grad(),
        pytest.raises(NotImplementedError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"),
    ):
        model(ids)
    engine = fxoffload_hf.engine_of(model)
    assert engine.runners == []  # eager, not captured
    handle.remove()
    with torch.no_grad():
        model(ids)  # nothing left lent or locked
    fxoffload_hf.restore(model)


def _graph_using_weight(op: str, target: object, *extra: object) -> tuple[torch.fx.Graph, torch.fx.Node]:
    graph = torch.fx.Graph()
    weight = graph.placeholder("weight")
    used = graph.create_node(op, target, (weight, *extra))  # type: ignore[arg-type]
    graph.output(used)
    return graph, weight


@pytest.mark.parametrize(
    "op, target, extra",
    [
        ("call_method", "div_", (2,)),
        ("call_method", "__iadd__", (1,)),
        ("call_method", "__setitem__", (0, 1.0)),
        ("call_function", operator.itruediv, (2,)),
        ("call_function", operator.setitem, (0, 1.0)),
        ("call_function", torch.Tensor.copy_, (0,)),
    ],
    ids=["div_", "__iadd__", "__setitem__", "itruediv", "setitem", "Tensor.copy_"],
)
def test_a_captured_write_into_a_weight_is_refused(op, target, extra):
    graph, weight = _graph_using_weight(op, target, *extra)
    with pytest.raises(NotImplementedError, match=r"writes into its weight w\.x"):
        graphs.refuse_weight_writes(graph, {weight: "w.x"})


@pytest.mark.parametrize(
    "op, target, extra",
    [
        ("call_method", "__getitem__", (0,)),
        ("call_method", "__rshift__", (1,)),
        ("call_method", "requires_grad_", (False,)),
        ("call_method", "div", (2,)),
        ("call_function", operator.getitem, (0,)),
        ("call_function", torch.Tensor.__getitem__, (0,)),
    ],
    ids=["__getitem__", "__rshift__", "requires_grad_", "div", "getitem", "Tensor.__getitem__"],
)
def test_a_captured_read_of_a_weight_is_allowed(op, target, extra):
    """Dunders end in ``_`` too: only the in-place ones write (the check read ``__getitem__`` as a write)."""
    graph, weight = _graph_using_weight(op, target, *extra)
    graphs.refuse_weight_writes(graph, {weight: "w.x"})
