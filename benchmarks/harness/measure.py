"""Measured generation (in a child): a seeded prompt, a warm-up, a timed prefill and greedy generate; and
batches of seeded prompts of different lengths, left-padded, timed as tokens per second of generate.

Token times come through :class:`~harness.protocol.StepClock`, so a parent that kills a slow child still
knows how far it got.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from typing import Any

from harness.engine import engine_report
from harness.protocol import StepClock, phase


def prompt(vocab: int, tokens: int, seed: int) -> dict[str, Any]:
    """Generation arguments of a seeded random prompt of ``tokens`` ids below ``vocab``: greedy, no padding."""
    import torch

    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}


def warm_up(lm: Any, gen: dict[str, Any], tokens: int) -> float:
    """Generate ``tokens`` and run one prefill forward (capture, profiling, first-use costs); seconds taken."""
    import torch

    phase("warmup")
    start = time.perf_counter()
    with torch.no_grad():
        generate(lm, gen, tokens, StepClock("warmup"))
        lm(input_ids=gen["input_ids"], attention_mask=gen["attention_mask"])
    return time.perf_counter() - start


def generate(lm: Any, gen: dict[str, Any], tokens: int, clock: StepClock) -> Any:
    """Greedy ``generate`` of exactly ``tokens`` new tokens, timed by ``clock``."""
    return lm.generate(max_new_tokens=tokens, min_new_tokens=tokens, logits_processor=[clock], **gen)


def timed(lm: Any, gen: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """A timed prefill forward, then a timed greedy generate of ``new_tokens``: seconds, rates, new tokens."""
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        lm(input_ids=gen["input_ids"], attention_mask=gen["attention_mask"])
        prefill_s = time.perf_counter() - start
        clock = StepClock("measure")
        start, started_at = time.perf_counter(), time.time()
        out = generate(lm, gen, new_tokens, clock)
        generate_s = time.perf_counter() - start
    return {
        "prefill_s": prefill_s,
        "generate_s": generate_s,
        "first_token_s": clock.times[0] - started_at if clock.times else None,
        "decode_tok_s": clock.decode_rate(),
        "tokens": out[0, gen["input_ids"].shape[1] :].tolist(),
    }


def random_prompts(vocab: int, count: int, shortest: int, longest: int, seed: int) -> list[list[int]]:
    """``count`` seeded prompts of random ids in ``[1, vocab)`` (0 is left for padding), each of a random
    length in ``[shortest, longest]``; no torch, so a parent can make the same prompts."""
    rng = random.Random(seed)
    lengths = [rng.randint(shortest, longest) for _ in range(count)]
    return [[rng.randrange(1, vocab) for _ in range(length)] for length in lengths]


def left_padded(prompts: list[list[int]], pad: int = 0) -> dict[str, Any]:
    """Generation arguments of ``prompts`` as one batch, padded on the left with ``pad`` and masked: greedy."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, ids_of in enumerate(prompts):
        ids[row, width - len(ids_of) :] = torch.tensor(ids_of, dtype=torch.long)
        mask[row, width - len(ids_of) :] = 1
    return {"input_ids": ids, "attention_mask": mask, "do_sample": False, "pad_token_id": pad}


def throughput(lm: Any, batches: list[dict[str, Any]], new_tokens: int, clock_phase: str) -> dict[str, Any]:
    """A greedy generate of ``new_tokens`` for each batch in turn: seconds of generate (prefill included),
    new tokens across all sequences per second, and each sequence's new tokens (batches in order)."""
    import torch

    seconds, tokens = 0.0, []
    with torch.no_grad():
        for gen in batches:
            start = time.perf_counter()
            out = generate(lm, gen, new_tokens, StepClock(clock_phase))
            seconds += time.perf_counter() - start
            tokens += out[:, gen["input_ids"].shape[1] :].tolist()
    return {"generate_s": seconds, "tok_s": sum(map(len, tokens)) / seconds, "tokens": tokens}


@contextlib.contextmanager
def timeline(lm: Any, png: str | None, trace: str | None, title: str) -> Iterator[None]:
    """Record fxoffload_hf's copy and compute per piece meanwhile, drawn to ``png`` and written as a Chrome
    trace to ``trace``; nothing for a model fxoffload_hf does not run or without either file."""
    if not (png or trace) or engine_report(lm) is None:
        yield
        return
    from fxoffload_hf.timeline import plot_timeline, record_timeline, write_chrome_trace

    with record_timeline(lm) as events:
        yield
    if events and png:
        plot_timeline(events, png, title=title)
    if events and trace:
        write_chrome_trace(events, trace)
