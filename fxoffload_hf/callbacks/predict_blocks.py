"""Lightning's predict loop in blocks of K batches: each weight streamed once for K batches.

``_PredictionLoop.run`` fetches a batch and runs ``_predict_step`` on it (hooks, ``predict_step``, the
prediction kept), one batch after another. In blocks, K batches are fetched, and their ``_predict_step``s
run as one block of calls (``cohort``): each reaches the offloaded model's graphs, and each graph runs
once for all K. Every batch still goes through all of ``_predict_step``: ``on_predict_batch_start`` of
the K batches run in order before the block's graphs, ``on_predict_batch_end`` (and prediction writers)
in order after, and the predictions are kept in order. The loop's per-batch state that hooks read
(``current_batch_indices``, ``batch_progress.is_last_batch``) is each batch's own while its step runs.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.loops.prediction_loop import _PredictionLoop
from lightning.pytorch.loops.utilities import _no_grad_context

from fxoffload_hf.engine import Engine


class PredictInBlocks:
    """The predict loop of a trainer run in blocks of ``size`` batches while installed."""

    def __init__(self, loop: _PredictionLoop, engine: Engine, size: int) -> None:
        self.loop = loop
        self.engine = engine
        self.size = size
        self.blocks: list[int] = []  # batches in each block run, in order
        loop.run = types.MethodType(_no_grad_context(self._run), loop)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        self.loop.__dict__.pop("run", None)

    def _run(self, loop: _PredictionLoop) -> Any:
        # the steps of ``_PredictionLoop.run`` (Lightning 2.x), fetching a block of batches at a time
        loop.setup_data()
        if loop.skip:
            return None
        loop.reset()
        fetcher = loop._data_fetcher
        if isinstance(fetcher, _DataLoaderIterDataFetcher):
            raise ValueError(
                "FxOffloadCallback(batches_per_block>1) needs predict_step(batch, batch_idx); a predict_step "
                "that takes the dataloader iterator fetches its own batches, which cannot be run as a block: "
                "use batches_per_block=1"
            )
        loop.on_run_start()
        assert fetcher is not None
        member_state = [(loop, "current_batch_indices"), (loop.batch_progress, "is_last_batch")]
        while True:
            block: list[tuple[Any, int, int, bool]] = []
            try:
                while len(block) < self.size and not (block and block[-1][3]):
                    batch, batch_idx, dataloader_idx = next(fetcher)
                    block.append((batch, batch_idx, dataloader_idx, fetcher.done))
            except StopIteration:
                pass
            finally:
                loop._restarting = False
            if not block:
                break
            steps = [functools.partial(_step, loop, *fetched) for fetched in block]
            self.engine.run_together(steps, member_state)
            self.blocks.append(len(block))
            if block[-1][3]:
                break
        return loop.on_run_end()


def _step(loop: _PredictionLoop, batch: Any, batch_idx: int, dataloader_idx: int, last: bool) -> None:
    loop.batch_progress.is_last_batch = last  # type: ignore[attr-defined]  # Lightning sets it so too
    loop._predict_step(batch, batch_idx, dataloader_idx, None)
