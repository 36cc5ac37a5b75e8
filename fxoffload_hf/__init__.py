"""fxoffload_hf: run Hugging Face models and Lightning modules larger than GPU (or CPU) memory.

The model is captured as FX graphs by a ``torch.compile`` backend, each graph is cut into pieces whose
weights fit a memory budget, and each piece's weights are streamed in while the piece before computes.
"""

from __future__ import annotations

from typing import Any

from fxoffload_hf.api import engine_of, is_offloaded, offload, restore, run_as_block
from fxoffload_hf.config import OffloadConfig, parse_budget
from fxoffload_hf.eager_fallback import EagerFallbackWarning
from fxoffload_hf.memory_model import BudgetTooSmallError
from fxoffload_hf.output_check import NaNOutputWarning
from fxoffload_hf.safetensors_io import CheckpointError

__version__ = "0.1.0"

_LAZY = {
    "from_pretrained": "fxoffload_hf.integrations.transformers",
    "AutoModelForCausalLM": "fxoffload_hf.integrations.transformers",
    "AutoModelForSeq2SeqLM": "fxoffload_hf.integrations.transformers",
    "AutoModel": "fxoffload_hf.integrations.transformers",
}


def __getattr__(name: str) -> Any:
    # transformers integration is imported on first use, keeping `import fxoffload_hf` light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxoffload_hf' has no attribute {name!r}")


__all__ = [
    "offload",
    "restore",
    "engine_of",
    "is_offloaded",
    "run_as_block",
    "OffloadConfig",
    "parse_budget",
    "BudgetTooSmallError",
    "CheckpointError",
    "EagerFallbackWarning",
    "NaNOutputWarning",
    "from_pretrained",
    "AutoModelForCausalLM",
    "AutoModelForSeq2SeqLM",
    "AutoModel",
]
