"""Files of weights written out of RAM (``WeightStore.spill``): each written whole or not at all, and
removed by the process that wrote it."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file


def write_weights_file(tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write ``tensors`` to a new safetensors file in ``folder``, atomically; its path.

    Raises:
        OSError: the folder cannot be written (no space, no permission); nothing partial is left.
    """
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"fxoffload-{uuid.uuid4().hex[:12]}.safetensors"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, tmp)
        os.replace(tmp, final)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError | SafetensorError):
            raise OSError(
                getattr(exc, "errno", None),
                f"cannot write offloaded weights to {folder}: {getattr(exc, 'strerror', None) or exc}; "
                "free space there or choose another offload_folder",
            ) from exc
        raise
    return final


def remove_written(paths: list[Path], writer: int) -> None:
    """Remove ``paths`` (files, then folders) where they still are, in the process ``writer`` only: a
    forked child that exits or lets go of its copy of a model leaves its parent's files alone."""
    if os.getpid() != writer:
        return
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    paths.clear()
