"""Lightning callbacks (import this package only where ``lightning`` is installed)."""

from fxoffload_hf.callbacks.offload_callback import FxOffloadCallback

__all__ = ["FxOffloadCallback"]
