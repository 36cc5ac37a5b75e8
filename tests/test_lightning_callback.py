"""FxOffloadCallback: Lightning's inference loops give the same results with and without offload."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import fxoffload_hf  # noqa: E402
from fxoffload_hf.callbacks import FxOffloadCallback  # noqa: E402
from fxoffload_hf.capture import handle_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_predict.py"


class LlamaModule(pl.LightningModule):
    """A tiny HF Llama in ``self.model``; every inference step records its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.seen: list[torch.Tensor] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def _step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        logits = self(batch[0])
        self.seen.append(logits.detach().clone())
        return logits

    def predict_step(self, batch, batch_idx):
        return self._step(batch)

    def test_step(self, batch, batch_idx):
        self._step(batch)

    def validation_step(self, batch, batch_idx):
        self._step(batch)

    def training_step(self, batch, batch_idx):
        return self(batch[0]).float().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class RecordingLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class GhostProbe(pl.Callback):
    """After Lightning's own setup (dtype conversion, move to device), look at the ghosts."""

    def __init__(self) -> None:
        self.ghosts: list[torch.nn.Parameter] = []

    def on_predict_start(self, trainer, pl_module) -> None:
        self.ghosts = [p for p in pl_module.parameters() if handle_of(p) is not None]
        self.storage_bytes = [p.untyped_storage().nbytes() for p in self.ghosts]
        self.device = trainer.strategy.root_device


def _data() -> DataLoader:
    ids = torch.randint(0, 1000, (6, 12), generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(ids), batch_size=2)


def _trainer(callbacks=(), precision="32-true", logger=False) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        callbacks=list(callbacks),
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _run(stage: str, module: LlamaModule, trainer: pl.Trainer) -> list[torch.Tensor]:
    if stage == "predict":
        trainer.predict(module, _data())
    elif stage == "test":
        trainer.test(module, _data(), verbose=False)
    else:
        trainer.validate(module, _data(), verbose=False)
    return module.seen


@pytest.fixture
def llama_module(build_model):
    """``llama_module(cls=LlamaModule)``: a new module around a fresh tiny Llama (the same weights each time)."""

    def make(cls: type[LlamaModule] = LlamaModule) -> LlamaModule:
        return cls(build_model("llama"))

    return make


@pytest.fixture
def half_budget(build_model, weight_bytes):
    """``half_budget(**kwargs)``: a callback whose GPU budget is half the tiny Llama's weights."""
    budget = int(weight_bytes(build_model("llama")) * 0.5)

    def make(**kwargs) -> FxOffloadCallback:
        return FxOffloadCallback(gpu_memory=budget, **kwargs)

    return make


def _assert_restored(module: LlamaModule, before: dict[str, tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    assert not hasattr(module.model, "_fxoffload_state") and not hasattr(module, "_fxoffload_state")
    assert "forward" not in module.__dict__ and "forward" not in module.model.__dict__
    assert not hasattr(module, "_ddp_params_and_buffers_to_ignore")
    params = dict(module.named_parameters())
    assert params.keys() == before.keys()
    for name, (original, values) in before.items():
        assert params[name] is original, name
        assert params[name].device == values.device and torch.equal(params[name], values), name


@pytest.mark.parametrize(
    "stage, target", [("predict", "model"), ("test", "model"), ("validate", "model"), ("predict", None)]
)
def test_inference_loops_equal_plain_runs(stage, target, llama_module, half_budget):
    expected = _run(stage, llama_module(), _trainer())
    callback = half_budget(target=target)
    got = _run(stage, llama_module(), _trainer([callback]))
    assert len(got) == len(expected) == 3
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    stats = callback.last_stats
    assert stats["stage"] == stage and stats["calls"] == 3
    assert stats["pieces_run"] >= 4 * stats["calls"]


class GraphCounter(pl.Callback):
    """Counts the offloaded module's captured graphs after every predict batch."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.counts.append(len(fxoffload_hf.engine_of(pl_module).runners))


def test_predict_steps_of_new_lengths_and_batch_sizes_reuse_the_graphs(llama_module, half_budget):
    generator = torch.Generator().manual_seed(4)
    shapes = [(2, 12), (2, 5), (3, 20), (4, 9), (2, 31), (3, 7)]
    batches = [[torch.randint(0, 1000, shape, generator=generator)] for shape in shapes]
    loader = DataLoader(batches, batch_size=None)
    expected = _trainer().predict(llama_module(), loader)
    counter = GraphCounter()
    got = _trainer([half_budget(), counter]).predict(llama_module(), loader)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # sizes are symbolic from the first step: one graph serves every length and batch size above 1
    assert counter.counts == [1] * len(shapes), counter.counts


def test_deferred_capture_predicts_eagerly_and_exactly(llama_module, half_budget):
    expected = _run("predict", llama_module(), _trainer())
    callback = half_budget(target="model", capture="deferred")
    got = _run("predict", llama_module(), _trainer([callback]))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert callback.last_stats["eager_calls"] == 3 and callback.last_stats["graphs"] == 0


def test_teardown_restores_module_and_logs_stats(tmp_path, llama_module, weight_bytes):
    module = llama_module()
    before = {n: (p, p.detach().clone()) for n, p in module.named_parameters()}
    logger = RecordingLogger()
    callback = FxOffloadCallback(
        cpu_memory=int(weight_bytes(module) * 0.6),
        offload_folder=tmp_path,
        target="model",
        policy="sequential",
    )
    _run("predict", module, _trainer([callback], logger=logger))
    _assert_restored(module, before)
    assert list(tmp_path.iterdir()) == []
    stats = callback.last_stats
    assert stats["bytes_streamed"] > 0 and 0.0 <= stats["hidden_copy_share"] <= 1.0
    assert stats["peak_memory_bytes/cpu"] > 0 and stats["device"] == "cpu"
    logged = {k: v for m in logger.metrics for k, v in m.items()}
    assert logged["fxoffload/predict/bytes_streamed"] == stats["bytes_streamed"]
    assert logged["fxoffload/predict/hidden_copy_share"] == stats["hidden_copy_share"]
    assert logged["fxoffload/predict/peak_memory_bytes/cpu"] > 0


def test_callback_serves_several_runs(llama_module, half_budget):
    module, callback = llama_module(), half_budget(target="model")
    trainer = _trainer([callback])
    first = list(_run("validate", module, trainer))
    module.seen.clear()
    assert torch.equal(torch.cat(_run("predict", module, trainer)), torch.cat(first))
    assert callback.last_stats["stage"] == "predict"


def test_module_is_restored_when_a_step_fails(llama_module, half_budget):
    class Failing(LlamaModule):
        def predict_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("step failed")
            return self._step(batch)

    module = llama_module(Failing)
    before = {n: (p, p.detach().clone()) for n, p in module.named_parameters()}
    with pytest.raises(RuntimeError, match="step failed"):
        _run("predict", module, _trainer([half_budget(target="model")]))
    _assert_restored(module, before)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_lightning_setup_neither_copies_nor_converts_ghosts(precision, llama_module, half_budget):
    probe = GhostProbe()
    _run("predict", llama_module(), _trainer([half_budget(target="model"), probe], precision=precision))
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert len(probe.ghosts) >= 4
    for ghost, nbytes in zip(probe.ghosts, probe.storage_bytes, strict=True):
        assert ghost.device == probe.device and ghost.dtype == dtype
        assert nbytes <= ghost.element_size(), "a ghost was materialized"


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_precision_gives_the_same_predictions(precision, llama_module, half_budget):
    # on the CPU Lightning runs "16-mixed" as bf16 autocast: "bf16-mixed" covers it
    expected = _run("predict", llama_module(), _trainer(precision=precision))
    got = _run("predict", llama_module(), _trainer([half_budget(target="model")], precision=precision))
    assert expected[0].dtype == torch.bfloat16
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


def test_fit_is_refused(llama_module, half_budget):
    module = llama_module()
    with pytest.raises(ValueError, match="inference loops.*not 'fit'"):
        _trainer([half_budget(target="model")]).fit(module, _data())
    assert not hasattr(module.model, "_fxoffload_state")


def test_missing_target_is_refused_at_setup(llama_module, half_budget):
    with pytest.raises(ValueError, match="no submodule"):
        _trainer([half_budget(target="encoder")]).predict(llama_module(), _data())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu_memory": "lots"}, "gpu_memory: cannot read"),
        ({"cpu_memory": -5}, "cpu_memory: must be positive"),
        ({"policy": "eager"}, "policy"),
        ({"target": "model..layers"}, "target"),
        ({"target": 3}, "target"),
        ({"offload_folder": 3}, "offload_folder"),
        ({"log_stats": "yes"}, "log_stats"),
        ({"capture": "later"}, "capture"),
        ({"batches_per_block": 0}, "batches_per_block"),
        ({"batches_per_block": True}, "batches_per_block"),
    ],
)
def test_constructor_validates_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FxOffloadCallback(**kwargs)


def test_a_model_offloaded_before_the_run_predicts_in_blocks_and_stays_offloaded(tmp_path, save_checkpoint):
    eager = save_checkpoint("llama", tmp_path / "ckpt")
    expected = _trainer().predict(LlamaModule(eager), _data())
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", cpu_memory=1_500_000, device="cpu")
    callback = FxOffloadCallback(target="model", batches_per_block=2)
    for _ in range(2):  # the second run's figures are its own
        got = _trainer([callback]).predict(LlamaModule(model), _data())
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert fxoffload_hf.is_offloaded(model)
        assert callback.last_stats["calls"] == 3 and callback.last_stats["bytes_streamed"] > 0
    with pytest.raises(ValueError, match="already offloaded: pass target='model'"):
        _trainer([FxOffloadCallback()]).predict(LlamaModule(model), _data())
    with pytest.raises(ValueError, match="already offloaded .* cpu_memory apply only"):
        _trainer([FxOffloadCallback(target="model", cpu_memory="1MB")]).predict(LlamaModule(model), _data())
    with pytest.raises(ValueError, match="converts the module's weights"):
        _trainer([FxOffloadCallback(target="model")], precision="bf16-true").predict(
            LlamaModule(model), _data()
        )
    assert fxoffload_hf.is_offloaded(model)
    assert torch.equal(_trainer().predict(LlamaModule(model), _data())[0], expected[0])
    fxoffload_hf.restore(model)


def _run_example(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture
def reference(build_model):
    """``reference(ids)``: the last-position logits of the tiny Llama, without offload."""

    def last_logits(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return build_model("llama")(ids).logits[:, -1]

    return last_logits


@pytest.mark.parametrize("block, runs", [(1, 4), (2, 3)])
def test_example_runs_on_a_tiny_model(tmp_path, reference, block, runs):
    args = ["--cpu-memory", "2MB", "--policy", "sequential", "--offload-folder", str(tmp_path / "off")]
    proc = _run_example([*args, "--batches-per-block", str(block), "--save-dir", str(tmp_path)])
    assert proc.stdout.count("next token") == 8
    stats = json.loads((tmp_path / "stats-rank0.json").read_text())
    assert stats["bytes_streamed"] > 0 and stats["calls"] == 4
    # in blocks of two: the first batch is captured alone, the second waits for the next run
    assert stats["graph_runs"] == runs
    saved = torch.load(tmp_path / "predictions-rank0.pt")
    assert torch.equal(saved["logits"], reference(saved["ids"]))


@pytest.mark.slow
def test_two_process_ddp_predict_equals_one_process_without_offload(tmp_path, reference):
    _run_example(["--devices", "2", "--strategy", "ddp", "--save-dir", str(tmp_path)])
    parts = [torch.load(tmp_path / f"predictions-rank{r}.pt") for r in (0, 1)]
    assert all(len(p["index"]) == 4 for p in parts)
    index = torch.cat([p["index"] for p in parts])
    ids = torch.cat([p["ids"] for p in parts])[index.argsort()]
    logits = torch.cat([p["logits"] for p in parts])[index.argsort()]
    assert index.sort().values.tolist() == list(range(8))
    assert torch.equal(logits, reference(ids))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"stats-rank{rank}.json").read_text())["calls"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true"])
def test_cuda_predict_equals_plain_run_and_returns_weights_to_host(precision, llama_module, half_budget):
    def trainer(callbacks=()):
        return pl.Trainer(
            accelerator="gpu",
            devices=1,
            precision=precision,
            callbacks=list(callbacks),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    expected = _run("predict", llama_module(), trainer())
    module = llama_module()
    callback = half_budget(target="model")
    got = _run("predict", module, trainer([callback]))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert f"peak_memory_bytes/{callback.last_stats['device']}" in callback.last_stats
    assert all(p.device.type == "cpu" for p in module.parameters())
