"""``from_pretrained(..., offload="fx")``: a Hugging Face checkpoint loaded without holding its weights.

Transformers builds the model on the meta device and, asked to place everything on ``"disk"``, indexes
every parameter in the original safetensors files (its own key renames, weight converters, tying and
dtype plan applied) without copying them; it reads each tensor once on the way, one at a time. We take that index, drop accelerate's hooks, and hand the
model to ``fxoffload_hf.offload`` with each parameter pointing at its bytes in the checkpoint.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm

from fxoffload_hf import temp_folders
from fxoffload_hf.api import offload as offload_model
from fxoffload_hf.api import remove_on_restore
from fxoffload_hf.folios import drop_small_folios
from fxoffload_hf.integrations.hf_kwargs import read_hf_placement
from fxoffload_hf.safetensors_io import CheckpointError, TensorSlice, read_header

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def from_pretrained(
    path: str | os.PathLike[str],
    offload: str | None = "fx",
    *,
    gpu_memory: Any = None,
    cpu_memory: Any = None,
    offload_folder: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device | None = None,
    policy: str = "auto",
    capture: str | None = None,
    compile_cache: bool | str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    auto_class: Any = None,
    **hf_kwargs: Any,
) -> nn.Module:
    """Load a checkpoint folder as an offloaded model (``offload="fx"``), or as plain Hugging Face does.

    Args:
        path: a local checkpoint folder (or a hub id already in the local cache).
        offload: ``"fx"`` to offload; ``None`` for Hugging Face's own ``from_pretrained``.
        gpu_memory, cpu_memory, offload_folder, device, policy, capture, compile_cache: as for
            ``fxoffload_hf.offload``.
        dtype: compute dtype (``torch.bfloat16``, ``"float16"``, ...); weights convert as they stream.
        allow_pickle: pickle checkpoints (``.bin``/``.pt``) are refused unless this is True; they are
            then read with ``torch.load(weights_only=True)``.
        trust_remote_code: passed to transformers; False by default.
        auto_class: the transformers auto class (default ``AutoModelForCausalLM``, or ``AutoModel``
            for architectures without a language-model head).
        hf_kwargs: Hugging Face's own keywords, with Hugging Face's meaning: ``max_memory`` (``{0: "10GiB",
            "cpu": "30GiB"}``) sets the budgets, ``device_map="auto"`` lets fxoffload place the weights,
            ``torch_dtype`` is ``dtype``; those that only shape the model (``attn_implementation``, config
            overrides, ``revision``) pass to transformers; placement and format keywords fxoffload cannot
            honour (quantization, tensor parallelism, ``state_dict``, ...) are refused.

    Raises:
        FileNotFoundError: the folder does not exist and no cached copy is found.
        CheckpointError: a shard is missing, corrupt, or disagrees with the config.
        ValueError: a bad ``offload`` value, budget or device, or a keyword that cannot be honoured.
    """
    if offload not in (None, "fx"):
        raise ValueError(
            f"offload={offload!r} is not supported; use offload='fx', or leave it out for plain loading"
        )
    if offload is None:
        given = {
            "gpu_memory": gpu_memory is not None,
            "cpu_memory": cpu_memory is not None,
            "device": device is not None,
            "policy": policy != "auto",
            "capture": capture is not None,
            "compile_cache": compile_cache is not None,
        }
        named = [name for name, set_ in given.items() if set_]
        if named:
            raise ValueError(
                f"{', '.join(named)} only applies with offload='fx'; pass offload='fx', or use Hugging Face's "
                "own keywords (device_map, max_memory) for plain loading"
            )
        cls = auto_class or transformers.AutoModelForCausalLM
        if offload_folder is not None:
            hf_kwargs["offload_folder"] = offload_folder  # the same keyword, the same meaning
        return cls.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code, **hf_kwargs)
    placement, hf_kwargs = read_hf_placement(
        hf_kwargs, gpu_memory=gpu_memory, cpu_memory=cpu_memory, device=device, dtype=dtype
    )
    folder = resolve_checkpoint_folder(path)
    shards = validate_checkpoint(folder, allow_pickle=allow_pickle)
    target_dtype = _as_dtype(placement.dtype)
    work = temp_folders.make("fxoffload-hf-")
    model = None
    try:
        cls = auto_class or _default_auto_class(folder, trust_remote_code)
        with _quiet(
            "accelerate.big_modeling"
        ):  # its "parameters are on the meta device" is about its own offload
            model = cls.from_pretrained(
                folder,
                device_map={"": "disk"},
                offload_folder=str(work),
                dtype="auto",  # the checkpoint's own dtype: a cast here would read every tensor up front
                trust_remote_code=trust_remote_code,
                use_safetensors=None if allow_pickle else True,
                **hf_kwargs,
            )
        checkpoint = _checkpoint_index(model, shards)
        if target_dtype is not None:
            _cast_on_meta(model, target_dtype)
        offload_model(
            model,
            gpu_memory=placement.gpu_memory,
            cpu_memory=placement.cpu_memory,
            offload_folder=offload_folder,
            device=placement.device,
            policy=policy,
            capture=capture,
            compile_cache=compile_cache,
            checkpoint=checkpoint,
            entry_points=_entry_points(model),
        )
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    # Transformers read every tensor once to index it. Its pages sit in the page cache as small folios
    # (charged to us under a memory limit); read afresh by the engine they come in 2 MiB folios, which
    # are about twenty times cheaper to map and unmap per piece. Files cached in 2 MiB folios already
    # (an earlier process's engine read them) are kept.
    drop_small_folios(sorted({s.path for s in checkpoint.values()}))
    remove_on_restore(model, work)
    return model


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Only errors from ``logger_name`` inside the block."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def resolve_checkpoint_folder(path: str | os.PathLike[str]) -> Path:
    """A local folder, or the local cached snapshot of a hub id (never the network)."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise FileNotFoundError(f"{folder} is a file; pass the checkpoint folder that holds config.json")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure here means "not available locally"
        raise FileNotFoundError(
            f"{path}: no such folder, and no cached copy of a hub model by that id; fxoffload_hf loads from local "
            "files: download it first (e.g. `hf download ID --local-dir DIR`) or check the path"
        ) from None


def validate_checkpoint(folder: Path, *, allow_pickle: bool) -> dict[Path, dict[str, TensorSlice]]:
    """Check config, index and every shard's header before anything is built; return each shard's tensors.

    Raises:
        CheckpointError: with the file or tensor at fault and what to do.
    """
    if not (folder / "config.json").exists():
        raise CheckpointError(f"{folder}: no config.json; pass a folder written by save_pretrained")
    safetensors = sorted(folder.glob("*.safetensors"))
    index_file = folder / "model.safetensors.index.json"
    if not safetensors and not index_file.exists():
        pickles = [p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if not pickles:
            raise CheckpointError(f"{folder}: no weights found (no *.safetensors, no index)")
        if not allow_pickle:
            raise CheckpointError(
                f"{folder}: holds only pickle weights ({pickles[0].name}); pickle files can run code when loaded. "
                "Convert them to safetensors, or pass allow_pickle=True to read them with torch.load(weights_only=True)"
            )
        return {}
    expected: dict[str, str] = {}
    if index_file.exists():
        try:
            expected = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index_file}: not a valid safetensors index ({exc})") from None
        files = sorted({folder / name for name in expected.values()})
    else:
        files = safetensors
    shards: dict[Path, dict[str, TensorSlice]] = {}
    for file in tqdm(files, desc="Checking shards", unit="shard", disable=len(files) < 2):
        if not file.exists():
            raise CheckpointError(
                f"{file}: shard named by {index_file.name} is missing; restore it or re-download"
            )
        shards[file.resolve()] = read_header(file)
    for key, name in expected.items():
        if key not in shards[(folder / name).resolve()]:
            raise CheckpointError(
                f"{index_file}: says tensor {key!r} is in {name}, but that shard does not hold it; "
                "the checkpoint is inconsistent: re-download or re-save it"
            )
    return shards


def _checkpoint_index(model: nn.Module, shards: dict[Path, dict[str, TensorSlice]]) -> dict[str, TensorSlice]:
    """Parameter name → bytes in a file, from accelerate's disk hooks; the hooks are then removed.

    Parameters the checkpoint lacks (Marian's sinusoidal tables: transformers computes them) were made on
    the CPU before the hooks came, and each hook moved its module's parameters to meta with no value left
    to bring back: their hooks forget them (a detach would fail on them) and they are made again.
    """
    from accelerate.hooks import remove_hook_from_module

    index: dict[str, TensorSlice] = {}
    headers = dict(shards)
    dropped: list[tuple[nn.Module, str]] = []
    for module_name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        weights_map = getattr(hook, "weights_map", None)
        if hook is None or weights_map is None:
            continue
        entries = weights_map.dataset.index
        for pname, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            info = entries.get(f"{weights_map.prefix}{pname}")
            if _dropped_by_hook(hook, pname, param, info):
                hook.original_devices.pop(pname)
                dropped.append((module, pname))
                continue
            if info is None or "safetensors_file" not in info:
                continue
            file = Path(info["safetensors_file"]).resolve()
            if file not in headers:
                headers[file] = read_header(file)  # a tensor transformers converted and saved once
            source = headers[file].get(info.get("weight_name", full))
            if source is None:
                raise CheckpointError(f"{file}: does not hold tensor {info.get('weight_name', full)!r}")
            if source.shape != tuple(param.shape):
                raise CheckpointError(
                    f"{file}: tensor {source.key!r} has shape {list(source.shape)} but the config makes "
                    f"{full} {list(param.shape)}; the checkpoint does not match its config.json"
                )
            index[full] = source
    remove_hook_from_module(model, recurse=True)
    model.__dict__.pop("hf_device_map", None)
    _initialize_again(model, dropped)
    return index


def _dropped_by_hook(hook: Any, pname: str, param: nn.Parameter, info: dict | None) -> bool:
    """A parameter that was real before its offloading hook came and that nothing can bring back."""
    original = getattr(hook, "original_devices", {}).get(pname)
    if original is None or original.type == "meta" or param.device.type != "meta" or info is not None:
        return False
    return f"{hook.weights_map.prefix}{pname}" not in hook.weights_map.dataset.state_dict


def _initialize_again(model: nn.Module, dropped: list[tuple[nn.Module, str]]) -> None:
    """Make the dropped parameters again on the CPU with transformers' own initialisation of missing keys
    (``initialize_weights`` visits only the modules not marked initialised: here, their owners)."""
    if not dropped:
        return
    initialize = getattr(model, "initialize_weights", None)
    if not callable(initialize):
        names = ", ".join(f"{type(m).__name__}.{p}" for m, p in dropped)
        raise CheckpointError(f"the checkpoint does not hold {names}, and the model cannot initialise it")
    for module, pname in dropped:
        param = module._parameters[pname]
        assert param is not None
        module._parameters[pname] = nn.Parameter(
            torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad
        )
        module.__dict__["_is_hf_initialized"] = False  # transformers' flag, a plain attribute
    initialize()


def _cast_on_meta(model: nn.Module, dtype: torch.dtype) -> None:
    """Give parameters the compute dtype Hugging Face would (its fp32 plan kept); weights convert as they
    stream, so no converted copy of the model is ever made. Small resident tensors convert at offload."""
    get_plan = getattr(model, "_get_dtype_plan", None)
    plan: dict[str, torch.dtype] = get_plan(dtype) if callable(get_plan) else {}
    keep = [re.compile(rf"(^|\.){re.escape(p)}(\.|$)") for p in plan]
    own = _dtypes_built_in(model, dtype)
    cast: dict[nn.Parameter, nn.Parameter] = {}  # tied parameters stay one object
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in list(module._parameters.items()):
            if param is None or not param.is_floating_point():
                continue
            if param not in cast:
                full = f"{name}.{attr}" if name else attr
                wanted = torch.float32 if any(k.search(full) for k in keep) else own.get(full, dtype)
                cast[param] = (
                    param if param.dtype == wanted else nn.Parameter(param.to(wanted), param.requires_grad)
                )
            module._parameters[attr] = cast[param]
    model.config.dtype = dtype


def _dtypes_built_in(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Each parameter's dtype in ``model``'s class built for ``dtype`` (on the meta device): Hugging Face
    loads a checkpoint tensor in the dtype its module gives the parameter where that is not ``dtype``
    (Gated DeltaNet layers make ``A_log`` in fp32 whatever the dtype asked), and in ``dtype`` elsewhere.
    Empty where the class cannot be built so (every parameter then takes ``dtype``)."""
    from_config = getattr(type(model), "_from_config", None)
    if from_config is None:
        return {}
    try:
        with torch.device("meta"), _quiet("transformers"):
            built = from_config(copy.deepcopy(model.config), dtype=dtype)
    except Exception:  # noqa: BLE001 - a class that only builds from its checkpoint: the dtype for all
        return {}
    return {
        name: p.dtype for name, p in built.named_parameters(remove_duplicate=False) if p.is_floating_point()
    }


def _entry_points(model: nn.Module) -> tuple[str, ...]:
    """``forward``, plus the encoder of encoder-decoder models (``generate`` calls it on its own)."""
    entries = ["forward"]
    get_encoder = getattr(model, "get_encoder", None)
    if getattr(model.config, "is_encoder_decoder", False) and get_encoder is not None:
        encoder = get_encoder()
        for name, module in model.named_modules():
            if module is encoder and name:
                entries.append(f"{name}.forward")
                break
    return tuple(entries)


def _default_auto_class(folder: Path, trust_remote_code: bool) -> Any:
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    if getattr(config, "is_encoder_decoder", False):
        return transformers.AutoModelForSeq2SeqLM
    architectures = getattr(config, "architectures", None) or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return transformers.AutoModelForCausalLM
    return transformers.AutoModel


def _as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype: {dtype!r} is not a torch dtype; use e.g. torch.bfloat16 or 'float16'")
    return value


class _AutoShim:
    """``fxoffload_hf.AutoModel*``: Hugging Face's class, plus ``offload="fx"``."""

    _hf_name = "AutoModel"

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *args: Any, offload: str | None = None, **kwargs: Any
    ) -> Any:
        hf_class = getattr(transformers, cls._hf_name)
        if offload is None:
            return hf_class.from_pretrained(path, *args, **kwargs)
        if args:
            raise ValueError("pass from_pretrained options by keyword when offload='fx'")
        return from_pretrained(path, offload=offload, auto_class=hf_class, **kwargs)


class AutoModelForCausalLM(_AutoShim):
    _hf_name = "AutoModelForCausalLM"


class AutoModelForSeq2SeqLM(_AutoShim):
    _hf_name = "AutoModelForSeq2SeqLM"


class AutoModel(_AutoShim):
    _hf_name = "AutoModel"
