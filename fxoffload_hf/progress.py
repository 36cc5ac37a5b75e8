"""What fxoffload_hf tells a person while it works: one log line per stage (weights stored, a graph
captured and cut, a graph profiled), on stderr, the way Transformers reports its loading.

The lines go through the ``fxoffload_hf`` logger. Unless the program has given that logger a handler of
its own, one is added that writes ``fxoffload_hf: ...`` to stderr at the level of
``FXOFFLOAD_HF_VERBOSITY`` (``debug``, ``info`` (default), ``warning``, ``error``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("fxoffload_hf")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_ENV = "FXOFFLOAD_HF_VERBOSITY"


def _configure() -> None:
    if logger.handlers:
        return
    wanted = os.environ.get(_ENV, "info").lower()
    if wanted not in _LEVELS:
        raise ValueError(f"{_ENV}={wanted!r}: use one of {', '.join(_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("fxoffload_hf: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(_LEVELS[wanted])
    logger.propagate = False  # one line, not one more from the root logger a program configured


def report(message: str, *args: object) -> None:
    """Log one stage's line at INFO."""
    _configure()
    logger.info(message, *args)


def warn(message: str, *args: object) -> None:
    """Log a line at WARNING: something that works, but costs the person time they can save."""
    _configure()
    logger.warning(message, *args)


@contextmanager
def stage(message: str, *args: object) -> Iterator[None]:
    """Log ``message`` with the seconds the block took, once it ends (not if it raises)."""
    start = time.perf_counter()
    yield
    report(message + " (%.1f s)", *args, time.perf_counter() - start)
