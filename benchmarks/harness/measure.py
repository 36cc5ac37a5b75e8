"""One measured generation (in a child): a seeded prompt, a warm-up, a timed prefill and greedy generate.

Token times come through :class:`~harness.protocol.StepClock`, so a parent that kills a slow child still
knows how far it got.
"""

from __future__ import annotations

import contextlib
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
