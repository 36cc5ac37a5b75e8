"""Calls run as one block (``fxoffload_hf.run_as_block``): each graph runs once for every call waiting at it,
so a weight streams in once per block, and every call's result equals eager's bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.runner import GraphRunner

LENGTHS = (5, 9, 7)


def _prompts(lengths=LENGTHS, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1000, (1, n), generator=gen) for n in lengths]


@pytest.fixture(params=["llama", "gpt2"])
def offloaded(request, build_model, weight_bytes):
    """An eager model and the same weights offloaded at a quarter of their bytes (many pieces, tiles)."""
    eager = build_model(request.param)
    model = build_model(request.param)
    fxoffload_hf.offload(model, cpu_memory=weight_bytes(model) // 4)
    yield eager, model
    fxoffload_hf.restore(model)


def _streamed(model) -> int:
    return fxoffload_hf.engine_of(model).stats.bytes_streamed


def test_a_block_of_forwards_equals_eager_and_streams_once(offloaded):
    eager, model = offloaded
    prompts = _prompts()
    with torch.no_grad():
        expected = [eager(input_ids=ids).logits for ids in prompts]
        model(input_ids=prompts[0])  # capture and profile the graph first
        before = _streamed(model)
        model(input_ids=prompts[1])
        one_call = _streamed(model) - before
        got = fxoffload_hf.run_as_block(
            model, [lambda ids=ids: model(input_ids=ids).logits for ids in prompts]
        )
        block = _streamed(model) - before - one_call
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert one_call > 0
    assert block == one_call  # the weights of three calls streamed once


def test_a_block_of_generates_equals_eager_per_prompt(offloaded):
    eager, model = offloaded
    prompts = _prompts((4, 11, 6))
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = [eager.generate(ids, **greedy) for ids in prompts]
    engine = fxoffload_hf.engine_of(model)
    got, groups = engine.run_together([lambda ids=ids: model.generate(ids, **greedy) for ids in prompts])
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    # each graph's first call runs alone (profiled); the other calls then share every run, whatever step
    # of their own each is at: the first prompt, one decode step ahead, ends first
    assert groups == [1, 2, 1, 3, 3, 3, 3, 2]
    assert engine.stats.graphs <= 2


def test_calls_that_cannot_fit_together_run_in_smaller_groups(offloaded, monkeypatch):
    eager, model = offloaded
    prompts = _prompts((8,) * 5)
    engine = fxoffload_hf.engine_of(model)
    calls = [lambda ids=ids: model(input_ids=ids).logits for ids in prompts]
    asked: list[int] = []
    with torch.no_grad():
        expected = [eager(input_ids=ids).logits for ids in prompts]
        model(input_ids=prompts[0])
        monkeypatch.setattr(engine, "fits_activations", lambda need: bool(asked.append(need)))
        fxoffload_hf.run_as_block(model, calls)
        one = asked[0] // 5  # five calls of one shape: each needs a fifth
        # room for the activations of two calls and a half at a time
        monkeypatch.setattr(engine, "fits_activations", lambda need: need <= 5 * one // 2)
        before = _streamed(model)
        model(input_ids=prompts[1])
        one_call = _streamed(model) - before
        got, groups = engine.run_together(calls)
        block = _streamed(model) - before - one_call
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    # halved until the calls that run fit (the others wait, holding their arguments): 2 of 5, 1 of 3, 2
    assert groups == [2, 1, 2]
    assert block == 3 * one_call


def test_a_failing_call_fails_the_block_after_the_others_end(offloaded):
    _, model = offloaded
    ended: list[int] = []

    def call(index: int):
        def run():
            model(input_ids=_prompts((6,), seed=index)[0])
            if index == 1:
                raise KeyError("member 1")
            ended.append(index)

        return run

    with torch.no_grad(), pytest.raises(KeyError, match="member 1"):
        fxoffload_hf.run_as_block(model, [call(i) for i in range(3)])
    assert ended == [0, 2]
    with torch.no_grad():  # the model still runs, outside any block
        model(input_ids=_prompts((4,))[0])
    assert fxoffload_hf.engine_of(model).cohort is None


def test_blocks_do_not_nest_and_other_threads_wait(offloaded):
    _, model = offloaded
    ids = _prompts((5,))[0]
    with pytest.raises(RuntimeError, match="do not nest"):
        fxoffload_hf.run_as_block(model, [lambda: fxoffload_hf.run_as_block(model, [lambda: model(ids)])])
    # a thread outside the block calls the model while the block runs: it waits for the block to end
    order: list[str] = []
    outside = threading.Thread(target=lambda: (model(ids), order.append("outside")))

    def member():
        outside.start()
        outside.join(0.5)  # cannot get in while the block holds the engine
        order.append("member")
        return model(ids)

    with torch.no_grad():
        fxoffload_hf.run_as_block(model, [member])
    outside.join()
    assert order == ["member", "outside"]


def test_an_interrupt_while_a_block_runs_ends_every_call_and_frees_the_model(offloaded, monkeypatch):
    eager, model = offloaded
    prompts = _prompts()
    engine = fxoffload_hf.engine_of(model)
    with torch.no_grad():
        model(input_ids=prompts[0])  # captured and profiled: the block's calls then run together
        real = GraphRunner.run_block

        def interrupted(self, calls):
            raise KeyboardInterrupt

        monkeypatch.setattr(GraphRunner, "run_block", interrupted)
        with pytest.raises(KeyboardInterrupt):
            fxoffload_hf.run_as_block(model, [lambda ids=ids: model(input_ids=ids) for ids in prompts])
        monkeypatch.setattr(GraphRunner, "run_block", real)
        assert engine.cohort is None
        took: list[bool] = []
        other = threading.Thread(
            target=lambda: took.append(engine.lock.acquire(timeout=5)) or engine.lock.release()
        )
        other.start()
        other.join()
        assert took == [True]
        assert torch.equal(model(input_ids=prompts[1]).logits, eager(input_ids=prompts[1]).logits)
