"""Lightning's predict, test and validate loops in blocks of K batches: each weight streamed once for K.

A loop's ``run`` fetches a batch and runs its step on it (hooks, ``*_step``, the output kept or logged),
one batch after another. In blocks, K batches are fetched, and their steps (``_predict_step``,
``_evaluation_step``) run as one block of calls (``cohort``): each reaches the offloaded model's graphs,
and each graph runs once for all K. Every batch still goes through all of its step: the ``*_batch_start``
hooks of the K batches run in order before the block's graphs, the ``*_batch_end`` hooks (prediction
writers, metrics logged by ``self.log``) in order after, and outputs are kept in order. The loop's
per-batch state that hooks and logging read (batch indices, ``is_last_batch``, the batch ``self.log``
takes its size from) is each batch's own while its step runs. A block never spans two dataloaders.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.loops.evaluation_loop import _EvaluationLoop
from lightning.pytorch.loops.fetchers import _DataFetcher, _DataLoaderIterDataFetcher
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.loops.utilities import _no_grad_context

from fxoffload_hf.engine import Engine

Loop = _PredictionLoop | _EvaluationLoop


@dataclass(frozen=True)
class _Fetched:
    batch: Any
    batch_idx: int
    dataloader_idx: int
    last: bool  # the loop's last batch (``is_last_batch``)


class LoopInBlocks:
    """A trainer's predict, test or validate loop run in blocks of ``size`` batches while installed."""

    def __init__(self, loop: Loop, engine: Engine, size: int) -> None:
        self.loop = loop
        self.engine = engine
        self.size = size
        self.blocks: list[int] = []  # batches in each block run, in order
        run = self._run_predict if isinstance(loop, _PredictionLoop) else self._run_evaluation
        loop.run = types.MethodType(_no_grad_context(run), loop)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        self.loop.__dict__.pop("run", None)

    def _run_predict(self, loop: _PredictionLoop) -> Any:
        # the steps of ``_PredictionLoop.run`` (Lightning 2.x), fetching a block of batches at a time
        loop.setup_data()
        if loop.skip:
            return None
        loop.reset()
        fetcher = _fetcher_of(loop, "predict_step(batch, batch_idx)")
        loop.on_run_start()
        member_state = [(loop, "current_batch_indices"), (loop.batch_progress, "is_last_batch")]
        for block in self._blocks(loop, fetcher):
            self._run_block(block, functools.partial(_predict_step, loop), member_state)
        return loop.on_run_end()

    def _run_evaluation(self, loop: _EvaluationLoop) -> Any:
        # the steps of ``_EvaluationLoop.run`` (Lightning 2.x), fetching a block of batches at a time
        loop.setup_data()
        if loop.skip:
            return []
        loop.reset()
        step = "test_step" if loop.trainer.testing else "validation_step"
        fetcher = _fetcher_of(loop, f"{step}(batch, batch_idx)")
        loop.on_run_start()
        connector, results = loop.trainer._logger_connector, loop.trainer._results
        member_state = [
            (loop.batch_progress, "is_last_batch"),
            (loop.trainer.lightning_module, "_current_fx_name"),  # the hook ``self.log`` logs for
            (connector, "_first_loop_iter"),
            (results, "batch"),  # what ``self.log`` takes the batch size from
            (results, "batch_size"),
            (results, "dataloader_idx"),
        ]
        previous_dataloader = 0
        for block in self._blocks(loop, fetcher):
            if block[0].dataloader_idx != previous_dataloader:
                loop._store_dataloader_outputs()  # the dataloader changed: as the plain loop tells the logger
            previous_dataloader = block[0].dataloader_idx
            self._run_block(block, functools.partial(_evaluation_step, loop), member_state)
        loop._store_dataloader_outputs()
        return loop.on_run_end()

    def _blocks(self, loop: Loop, fetcher: _DataFetcher) -> Iterator[list[_Fetched]]:
        """Blocks of up to ``size`` consecutive batches of one dataloader, the last ending at the last batch."""
        pending: _Fetched | None = None
        while True:
            block: list[_Fetched] = []
            try:
                while len(block) < self.size and not (block and block[-1].last):
                    if pending is None:
                        batch, batch_idx, dataloader_idx = next(fetcher)
                        pending = _Fetched(batch, batch_idx, dataloader_idx, fetcher.done)
                    if block and pending.dataloader_idx != block[0].dataloader_idx:
                        break
                    block.append(pending)
                    pending = None
            except StopIteration:
                pass
            finally:
                loop.on_iteration_done()
            if not block:
                return
            yield block
            if block[-1].last and pending is None:
                return

    def _run_block(
        self,
        block: list[_Fetched],
        step: Callable[[_Fetched], None],
        member_state: list[tuple[object, str]],
    ) -> None:
        self.engine.run_together([functools.partial(step, fetched) for fetched in block], member_state)
        self.blocks.append(len(block))


def _fetcher_of(loop: Loop, step: str) -> _DataFetcher:
    fetcher = loop._data_fetcher
    if isinstance(fetcher, _DataLoaderIterDataFetcher):
        raise ValueError(
            f"FxOffloadCallback(batches_per_block>1) needs {step}; a step that takes the dataloader "
            "iterator fetches its own batches, which cannot be run as a block: use batches_per_block=1"
        )
    assert fetcher is not None
    return fetcher


def _predict_step(loop: _PredictionLoop, fetched: _Fetched) -> None:
    loop.batch_progress.is_last_batch = fetched.last  # type: ignore[attr-defined]  # Lightning sets it so too
    loop._predict_step(fetched.batch, fetched.batch_idx, fetched.dataloader_idx, None)


def _evaluation_step(loop: _EvaluationLoop, fetched: _Fetched) -> None:
    loop.batch_progress.is_last_batch = fetched.last  # type: ignore[attr-defined]  # Lightning sets it so too
    loop._evaluation_step(fetched.batch, fetched.batch_idx, fetched.dataloader_idx, None)
