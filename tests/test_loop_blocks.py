"""FxOffloadCallback(batches_per_block=K): Lightning's predict, test and validate loops run K batches as one
block. Predictions and logged metrics equal a plain run's, in order; every batch's hooks and writers run;
each weight streams once per block; a block never spans two dataloaders."""

from __future__ import annotations

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import BasePredictionWriter  # noqa: E402
from test_lightning_callback import LlamaModule, RecordingLogger, _trainer  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from fxoffload_hf.callbacks import FxOffloadCallback  # noqa: E402

LENGTHS = (12, 5, 20, 9, 31, 7, 8)  # of the seven batches, two prompts each


class Prompts(Dataset):
    """Two prompts of each length in turn: batches of two hold prompts of one length."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(5)
        self.ids = [torch.randint(0, 1000, (n,), generator=generator) for n in LENGTHS for _ in range(2)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> list[torch.Tensor]:
        return [self.ids[index]]


@pytest.fixture
def llama_module(build_model):
    return lambda cls=LlamaModule: cls(build_model("llama"))


@pytest.fixture
def half_budget(build_model, weight_bytes):
    """A callback holding half the tiny Llama's weights on the compute device: most pieces resident."""
    budget = weight_bytes(build_model("llama")) // 2
    return lambda **kwargs: FxOffloadCallback(gpu_memory=budget, **kwargs)


def _loader() -> DataLoader:
    return DataLoader(Prompts(), batch_size=2)


class HookOrder(pl.Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_predict_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.events.append(("start", batch_idx))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        assert torch.equal(outputs, pl_module.seen[batch_idx])  # each batch's own prediction
        self.events.append(("end", batch_idx))


class Writer(BasePredictionWriter):
    """Records what a batch-interval prediction writer is given for each batch."""

    def __init__(self) -> None:
        super().__init__(write_interval="batch")
        self.written: list[tuple[int, list[int] | None, bool, torch.Tensor]] = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ):
        last = trainer.predict_loop.batch_progress.is_last_batch
        self.written.append((batch_idx, batch_indices, last, prediction))


def _predict(module, callbacks) -> list[torch.Tensor]:
    return _trainer(callbacks).predict(module, _loader())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_blocks_predict_what_batches_one_by_one_predict(precision, llama_module, half_budget):
    plain_writer = Writer()
    expected = _trainer([plain_writer], precision=precision).predict(llama_module(), _loader())
    order, writer = HookOrder(), Writer()
    callback = half_budget(target="model", batches_per_block=3)
    got = _trainer([callback, order, writer], precision=precision).predict(llama_module(), _loader())
    assert len(got) == len(expected) == len(LENGTHS)
    for a, b in zip(got, expected, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # blocks of 3, 3 and 1: the block's starts before its compute, its ends after, each batch in order
    blocks = [[0, 1, 2], [3, 4, 5], [6]]
    assert order.events == [(kind, i) for block in blocks for kind in ("start", "end") for i in block]
    assert [w[:3] for w in writer.written] == [w[:3] for w in plain_writer.written]
    assert [w[1] for w in writer.written] == [[2 * i, 2 * i + 1] for i in range(len(LENGTHS))]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(writer.written, plain_writer.written, strict=True))
    assert callback.last_stats["blocks"] == 3


def test_each_weight_streams_once_per_block(llama_module, weight_bytes):
    # half the weights in RAM: the rest stream from disk for every graph run
    budget = int(weight_bytes(llama_module()) * 0.5)
    one_by_one = FxOffloadCallback(cpu_memory=budget, target="model")
    blocks = FxOffloadCallback(cpu_memory=budget, target="model", batches_per_block=4)
    _predict(llama_module(), [one_by_one])
    _predict(llama_module(), [blocks])
    assert blocks.last_stats["calls"] == one_by_one.last_stats["calls"] == len(LENGTHS)
    # the first batch is captured and profiled alone, the rest of its block runs together, then the last three
    assert one_by_one.last_stats["graph_runs"] == len(LENGTHS)
    assert blocks.last_stats["graph_runs"] == 3 and blocks.last_stats["blocks"] == 2
    assert blocks.last_stats["bytes_streamed"] < one_by_one.last_stats["bytes_streamed"]


def test_a_predict_step_that_fetches_its_own_batches_is_refused(llama_module, half_budget):
    class IteratorStep(LlamaModule):
        def predict_step(self, dataloader_iter):
            batch, _, _ = next(dataloader_iter)
            return self._step(batch)

    module = llama_module(IteratorStep)
    with pytest.raises(ValueError, match="dataloader iterator.*batches_per_block=1"):
        _predict(module, [half_budget(target="model", batches_per_block=2)])
    assert not hasattr(module.model, "_fxoffload_state")
    assert "run" not in _trainer().predict_loop.__dict__


class LoggingModule(LlamaModule):
    """Logs a value of each batch's logits at every step and over the epoch, weighted by batch size."""

    def _log(self, batch: list[torch.Tensor], name: str) -> None:
        logits = self._step(batch)
        self.log(name, logits.float().pow(2).mean(), on_step=True, on_epoch=True, batch_size=len(batch[0]))

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self._log(batch, "test_value")

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self._log(batch, "val_value")


class EvaluationHooks(pl.Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, bool]] = []

    def _record(self, trainer, kind: str, batch_idx: int, dataloader_idx: int) -> None:
        loop = trainer.test_loop if trainer.testing else trainer.validate_loop
        self.events.append((kind, batch_idx, dataloader_idx, loop.batch_progress.is_last_batch))

    def on_test_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self._record(trainer, "start", batch_idx, dataloader_idx)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._record(trainer, "end", batch_idx, dataloader_idx)

    on_validation_batch_start = on_test_batch_start
    on_validation_batch_end = on_test_batch_end


def _evaluate(stage: str, module: LoggingModule, callbacks, loaders) -> tuple[list[dict[str, float]], list]:
    logger = RecordingLogger()
    trainer = _trainer(callbacks, logger=logger)
    run = trainer.test if stage == "test" else trainer.validate
    results = run(module, loaders, verbose=False)
    return logger.metrics, results


@pytest.mark.parametrize("stage", ["test", "validate"])
@pytest.mark.parametrize("loaders", [1, 2])
def test_evaluation_loops_in_blocks_log_what_batches_one_by_one_log(
    stage, loaders, llama_module, half_budget
):
    data = _loader() if loaders == 1 else [_loader(), _loader()]
    plain_hooks, hooks = EvaluationHooks(), EvaluationHooks()
    module, blocked = llama_module(LoggingModule), llama_module(LoggingModule)
    logged, results = _evaluate(stage, module, [plain_hooks], data)
    callback = half_budget(target="model", batches_per_block=3, log_stats=False)
    blocked_logged, blocked_results = _evaluate(stage, blocked, [callback, hooks], data)
    assert len(blocked.seen) == len(module.seen) == loaders * len(LENGTHS)
    assert all(torch.equal(a, b) for a, b in zip(blocked.seen, module.seen, strict=True))
    # per-step and per-epoch metrics, per dataloader, equal bit for bit and in the same order
    assert blocked_logged == logged and blocked_results == results
    assert len(logged) == loaders * len(LENGTHS) + 1
    # blocks of 3, 3 and 1 in each dataloader: starts before the block's compute, ends after, in order
    blocks = [[0, 1, 2], [3, 4, 5], [6]]
    assert [e[:3] for e in hooks.events] == [
        (kind, i, loader)
        for loader in range(loaders)
        for block in blocks
        for kind in ("start", "end")
        for i in block
    ]
    assert sorted(hooks.events) == sorted(plain_hooks.events)  # each batch's own is_last_batch
    assert callback.last_stats["blocks"] == 3 * loaders


def test_each_weight_streams_once_per_block_of_a_test_loop(llama_module, weight_bytes):
    budget = int(weight_bytes(llama_module()) * 0.5)
    one_by_one = FxOffloadCallback(cpu_memory=budget, target="model")
    blocks = FxOffloadCallback(cpu_memory=budget, target="model", batches_per_block=4)
    _evaluate("test", llama_module(LoggingModule), [one_by_one], _loader())
    _evaluate("test", llama_module(LoggingModule), [blocks], _loader())
    assert one_by_one.last_stats["graph_runs"] == len(LENGTHS)
    assert blocks.last_stats["graph_runs"] == 3 and blocks.last_stats["blocks"] == 2
    assert blocks.last_stats["bytes_streamed"] < one_by_one.last_stats["bytes_streamed"]


def test_the_loops_are_put_back_after_the_run(llama_module, half_budget):
    trainer = _trainer([half_budget(target="model", batches_per_block=2)])
    trainer.predict(llama_module(), _loader())
    trainer.test(llama_module(), _loader(), verbose=False)
    assert "run" not in trainer.predict_loop.__dict__ and "run" not in trainer.test_loop.__dict__
