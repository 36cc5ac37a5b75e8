"""``FxOffloadCallback``: run a LightningModule's predict, test or validate loop through fxoffload_hf.

Lightning's order decides where each step goes. ``Trainer._run`` calls the callbacks' ``setup`` first,
then ``strategy.setup``, which converts the module's dtype (``precision_plugin.convert_module``), moves it
to the root device (``model_to_device``) and, under DDP outside fitting, broadcasts every parameter from
rank 0. So ``setup`` converts the module itself before offloading (converting a ghost afterwards would
materialize it in full), offloads on the root device (the move then finds the ghosts already there and
copies nothing), and names the ghosts in ``_ddp_params_and_buffers_to_ignore`` (the broadcast would
flatten them into full buffers and cannot write into them). At the end, ``strategy.teardown`` moves the
module to the CPU *before* the callbacks' ``teardown``; a CUDA ghost moved there would become a full host
tensor, so the module is restored as soon as its loop ends, and ``teardown``/``on_exception`` only catch
what is left.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any

import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
from torch import nn

import fxoffload_hf
from fxoffload_hf.callbacks.loop_blocks import LoopInBlocks
from fxoffload_hf.capture import handle_of
from fxoffload_hf.compile_cache import resolve_cache_dir
from fxoffload_hf.config import POLICIES, BudgetSpec, parse_budget, resolve_capture
from fxoffload_hf.stats import Stats

_IGNORE_ATTR = "_ddp_params_and_buffers_to_ignore"
_STAGES = ("predict", "test", "validate")
_TARGET_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_MISSING = object()
_DEFAULTS = {"policy": "auto", "capture": None, "compile_cache": None}


class FxOffloadCallback(Callback):
    """Offload a LightningModule (or one of its submodules) for the inference loops of a ``Trainer``.

    The module is offloaded in ``setup`` of a ``predict``, ``test`` or ``validate`` run and restored
    (same parameter objects, values, ``forward`` and devices) when the loop ends. Statistics of the run
    are kept in ``last_stats`` and, when ``log_stats`` is true and the trainer has a logger, logged under
    ``fxoffload/<stage>/...``.

    The module to offload must exist when the ``Trainer`` starts: callbacks' ``setup`` runs before
    ``LightningModule.setup`` and ``configure_model``, so a model built there cannot be offloaded here.
    Steps must reach the offloaded weights through the offloaded module's ``forward`` (``self(x)`` when
    ``target`` is None, ``self.model(x)`` or ``self.model.generate(...)`` when ``target="model"``).
    Load weights before the run (``load_from_checkpoint``) rather than through ``ckpt_path=``: Lightning
    loads that checkpoint after the callbacks' ``setup``, into the ghosts, which cannot take it.

    A target already offloaded when the run starts (``fxoffload_hf.from_pretrained(path, offload="fx",
    cpu_memory=...)``: a model larger than RAM cannot be built whole first) runs as it is, with its own
    budget, device and dtype, and stays offloaded after the run; leave the budget arguments out then.

    Args:
        gpu_memory: bytes the engine may use on the compute device (see ``fxoffload_hf.offload``).
        cpu_memory: bytes of host RAM for weights; weights beyond it go to ``offload_folder``.
        offload_folder: where weights that must leave host RAM are written (default: a temporary folder).
        target: attribute path of the submodule to offload (``"model"``, ``"backbone.encoder"``); None
            offloads the LightningModule itself.
        policy: ``"auto"`` or ``"sequential"`` (see ``fxoffload_hf.offload``).
        capture: ``"deferred"`` (the default) or ``"first-call"`` (see ``fxoffload_hf.offload``).
        compile_cache: the compile cache's folder, True or False (see ``fxoffload_hf.offload``).
        log_stats: log bytes streamed, the share of copy time hidden and peak memory per device.
        batches_per_block: run this many consecutive batches of a predict, test or validate loop as one
            block: each graph of the model runs once for all of them, so each weight streams in once per
            block instead of once per batch (``fxoffload_hf.run_as_block``). Outputs, predictions and
            logged metrics are identical and in order; every batch's hooks and prediction writers still
            run, the ``*_batch_start`` hooks of the block's batches before its compute and the
            ``*_batch_end`` hooks after. The block holds the activations and outputs of all its batches
            at once (counted in the budget: batches that cannot fit together run in smaller groups).

    Raises:
        ValueError: at construction, for a bad budget, policy, target or folder; in ``setup``, for the
            ``fit`` stage, an unsupported strategy, a missing target or a budget the model cannot fit.
    """

    def __init__(
        self,
        gpu_memory: BudgetSpec = None,
        cpu_memory: BudgetSpec = None,
        offload_folder: str | os.PathLike[str] | None = None,
        target: str | None = None,
        policy: str = "auto",
        log_stats: bool = True,
        capture: str | None = None,
        batches_per_block: int = 1,
        compile_cache: bool | str | os.PathLike[str] | None = None,
    ) -> None:
        # percentages are resolved against free memory at setup; here only their form is checked
        parse_budget(gpu_memory, free_bytes=2**40, what="gpu_memory")
        parse_budget(cpu_memory, free_bytes=2**40, what="cpu_memory")
        if offload_folder is not None and not isinstance(offload_folder, str | os.PathLike):
            raise ValueError(f"offload_folder: expected a path or None, got {type(offload_folder).__name__}")
        if target is not None and (not isinstance(target, str) or not _TARGET_RE.match(target)):
            raise ValueError(
                f"target: expected an attribute path such as 'model' or 'backbone.encoder', or None for "
                f"the whole LightningModule, got {target!r}"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {POLICIES}")
        if capture is not None:
            resolve_capture(capture)
        if compile_cache is not None:
            resolve_cache_dir(compile_cache)
        if (
            isinstance(batches_per_block, bool)
            or not isinstance(batches_per_block, int)
            or batches_per_block < 1
        ):
            raise ValueError(f"batches_per_block: expected a whole number >= 1, got {batches_per_block!r}")
        if not isinstance(log_stats, bool):
            raise ValueError(f"log_stats: expected True or False, got {log_stats!r}")
        self.gpu_memory = gpu_memory
        self.cpu_memory = cpu_memory
        self.offload_folder = offload_folder
        self.target = target
        self.policy = policy
        self.capture = capture
        self.compile_cache = compile_cache
        self.log_stats = log_stats
        self.batches_per_block = batches_per_block
        self._blocks: LoopInBlocks | None = None
        self._owned = True  # offloaded by this callback (else before the run: left offloaded after it)
        self._stats_before = Stats()
        self.last_stats: dict[str, Any] = {}
        self._module: nn.Module | None = None
        self._device = torch.device("cpu")
        self._previous_ignore: Any = _MISSING
        self._peak_rss = 0

    # -- install and release --------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        stage = str(getattr(stage, "value", stage))  # Lightning passes a ``TrainerFn``
        if stage not in _STAGES:
            raise ValueError(
                f"FxOffloadCallback serves the inference loops {_STAGES}, not {stage!r}: offloaded weights "
                "are read-only ghosts that cannot be trained; remove the callback for trainer.fit"
            )
        strategy = trainer.strategy
        if not isinstance(strategy, SingleDeviceStrategy | DDPStrategy) or isinstance(
            strategy, DeepSpeedStrategy
        ):
            raise ValueError(
                f"FxOffloadCallback supports single-device and DDP strategies, not {type(strategy).__name__}"
            )
        module = self._resolve_target(pl_module)
        self._device = strategy.root_device
        self._owned = not fxoffload_hf.is_offloaded(module)
        inner = [name for name, m in module.named_modules() if name and fxoffload_hf.is_offloaded(m)]
        if self._owned and inner:
            raise ValueError(
                f"{type(module).__name__}.{inner[0]} is already offloaded: pass target={inner[0]!r} (with the "
                "path from the LightningModule) to run it as it is"
            )
        if self._owned:
            converted = trainer.precision_plugin.convert_module(pl_module)
            if converted is not pl_module:
                raise ValueError(
                    f"precision plugin {type(trainer.precision_plugin).__name__} replaces the module it "
                    "converts; FxOffloadCallback needs one that converts in place"
                )
            fxoffload_hf.offload(
                module,
                gpu_memory=self.gpu_memory,
                cpu_memory=self.cpu_memory,
                offload_folder=self.offload_folder,
                device=self._device,
                policy=self.policy,
                capture=self.capture,
                compile_cache=self.compile_cache,
            )
        else:
            self._check_offloaded_before(module, trainer)
        self._module = module
        engine = fxoffload_hf.engine_of(module)
        self._stats_before = copy.copy(engine.stats)
        if self.batches_per_block > 1:
            self._blocks = LoopInBlocks(_loop_of(trainer, stage), engine, self.batches_per_block)
        ghosts = [name for name, param in pl_module.named_parameters() if handle_of(param) is not None]
        self._previous_ignore = getattr(pl_module, _IGNORE_ATTR, _MISSING)
        previous = [] if self._previous_ignore is _MISSING else list(self._previous_ignore)
        setattr(pl_module, _IGNORE_ATTR, previous + ghosts)
        self._peak_rss = 0
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        self._sample_memory()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release(pl_module)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._release(pl_module)

    def _check_offloaded_before(self, module: nn.Module, trainer: pl.Trainer) -> None:
        """A target offloaded before the run (``fxoffload_hf.from_pretrained``: a model larger than RAM
        cannot be built whole for Lightning) runs with the budget it was given, on its own device, in its
        own dtype; the run leaves it offloaded."""
        own = {
            "gpu_memory": self.gpu_memory,
            "cpu_memory": self.cpu_memory,
            "offload_folder": self.offload_folder,
        }
        given = [name for name, value in own.items() if value is not None]
        given += [
            f"{name}={value!r}"
            for name, value in (
                ("policy", self.policy),
                ("capture", self.capture),
                ("compile_cache", self.compile_cache),
            )
            if value != _DEFAULTS[name]
        ]
        what = type(module).__name__
        if given:
            raise ValueError(
                f"the {what} is already offloaded (fxoffload_hf.from_pretrained or offload) with its own budget "
                f"and settings; {', '.join(given)} apply only to a module the callback offloads: drop them"
            )
        device = fxoffload_hf.engine_of(module).device
        if device != self._device:
            raise ValueError(
                f"the {what} was offloaded to compute on {device}, but the Trainer runs on {self._device}: "
                f"offload it with device={str(self._device)!r}, or give the Trainer that device"
            )
        plugin = trainer.precision_plugin
        if type(plugin) not in (Precision, MixedPrecision):
            raise ValueError(
                f"precision plugin {type(plugin).__name__} converts the module's weights, which an offloaded "
                "model cannot take: load it in the dtype you want (from_pretrained(..., dtype=...)) and use "
                "precision='32-true' or a mixed precision"
            )

    def _resolve_target(self, pl_module: pl.LightningModule) -> nn.Module:
        if self.target is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.target)
        except AttributeError:
            raise ValueError(
                f"target={self.target!r}: {type(pl_module).__name__} has no submodule at that path when the "
                "Trainer starts; pass the attribute that holds the model (built in __init__, not in "
                "setup or configure_model), or None for the whole LightningModule"
            ) from None

    def _release(self, pl_module: pl.LightningModule) -> None:
        if self._module is None:
            return
        module, self._module = self._module, None
        if self._blocks is not None:
            self._blocks.uninstall()
            self._blocks = None
        if self._previous_ignore is _MISSING:
            pl_module.__dict__.pop(_IGNORE_ATTR, None)
        else:
            setattr(pl_module, _IGNORE_ATTR, self._previous_ignore)
        self._previous_ignore = _MISSING
        if self._owned:
            fxoffload_hf.restore(module)

    # -- statistics -----------------------------------------------------------------------------
    def _sample_memory(self) -> None:
        self._peak_rss = max(self._peak_rss, psutil.Process().memory_info().rss)

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._module is None:
            return
        self._sample_memory()
        stats: dict[str, Any] = {"stage": stage, "device": str(self._device)}
        stats.update(fxoffload_hf.engine_of(self._module).stats.since(self._stats_before).as_dict())
        if self._blocks is not None:
            stats["blocks"] = len(self._blocks.blocks)
        # RSS is sampled after every batch: a peak inside a batch can be missed
        stats["peak_memory_bytes/cpu"] = self._peak_rss
        if self._device.type == "cuda":
            stats[f"peak_memory_bytes/{self._device}"] = torch.cuda.max_memory_allocated(self._device)
        self.last_stats = stats
        if self.log_stats:
            metrics = {
                f"fxoffload/{stage}/{key}": float(value)
                for key, value in stats.items()
                if isinstance(value, int | float)
            }
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        self._release(pl_module)

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._sample_memory()

    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._sample_memory()

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._sample_memory()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "predict")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "test")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "validate")


def _loop_of(trainer: pl.Trainer, stage: str) -> Any:
    """The loop a trainer runs for ``stage`` (one of ``_STAGES``)."""
    return getattr(trainer, f"{stage}_loop")  # predict_loop, test_loop, validate_loop
