"""The compile cache: what dynamo captured of a model's entry point, on disk, so that the next process
with the same model runs it without tracing again.

One entry per model and entry point, in a folder named by a key of everything that shapes the capture:
the model's class, its config and its weights' names, shapes and dtypes, the entry point, the device and
budgets, the capture mode, and the versions of fxoffload_hf, torch, Transformers and Python. An entry is
dynamo's package of the frame (``dynamo_package``) with each graph as dynamo gave it to the engine: a
second process installs it, and the engine cuts and plans each graph at its first call from the budget
it is given, as after a capture. An entry that cannot be read or installed (corrupt, written by other
versions, source files changed since) is removed with a warning and the call captured anew; a call the
saved guards do not pass (a new kind of call) is captured and the entry saved again with it.

Its folder is ``compile_cache`` (a path; True: the default; False: no cache), else
``$FXOFFLOAD_HF_COMPILE_CACHE`` (``off``: no cache), else ``~/.cache/fxoffload_hf/compiled`` (under
``$XDG_CACHE_HOME`` where set). Left to its default it is off under a host-memory budget (``cpu_memory``):
a process that saves graphs holds more per graph (``memory_model.SAVED_GRAPH_BYTES_PER_OP``: 13.6 MiB
more for the memory test's two graphs), so there it is used only where asked for, and then counted in
the budget (that test's run at half its weights, asked for: peak 1.3% over its budget, within its 5%).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import json
import os
import pickle
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from torch._dynamo.package import DiskDynamoStore, PrecompileCacheEntry
from torch._dynamo.precompile_context import BackendCacheArtifact, PrecompileContext

from fxoffload_hf import dynamo_package
from fxoffload_hf.progress import report, warn

if TYPE_CHECKING:
    from fxoffload_hf.config import OffloadConfig
    from fxoffload_hf.engine import Engine

CACHE_ENV = "FXOFFLOAD_HF_COMPILE_CACHE"
_OFF = ("0", "off", "false", "no", "none")
_GLOBALS_FILE = "globals.json"
# the engine whose entry point is running: a saved graph runs with it (graphs are shared by every model
# whose calls pass their guards, as dynamo's own cache entries are for one code object)
_RUNNING: contextvars.ContextVar[Engine | None] = contextvars.ContextVar("fxoffload_engine", default=None)


def resolve_cache_dir(
    value: bool | str | os.PathLike[str] | None, *, host_budget: bool = False
) -> Path | None:
    """The compile cache's folder for ``compile_cache=value`` (None: ``$FXOFFLOAD_HF_COMPILE_CACHE``, else
    the default folder, except under a host-memory budget); None where the cache is off."""
    if value is None:
        value = os.environ.get(CACHE_ENV)
        if value is None:
            # a capture that saves holds more than the budget counts (see the module's notes)
            return None if host_budget else _default_dir()
    if value is False or (isinstance(value, str) and value.strip().lower() in _OFF):
        return None
    if value is True:
        return _default_dir()
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"compile_cache: {value!r} is not a folder, True or False")
    return Path(value).expanduser()


def _default_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "fxoffload_hf" / "compiled"


def entry_key(model: nn.Module, entry: str, config: OffloadConfig) -> str:
    """The key of ``model``'s ``entry`` point under ``config`` (see the module's notes)."""
    import transformers

    import fxoffload_hf

    model_config: Any = getattr(model, "config", None)
    described = model_config.to_dict() if hasattr(model_config, "to_dict") else None
    if isinstance(described, dict):
        described.pop("_name_or_path", None)  # the same model from another folder is the same model
    parts = {
        "versions": [fxoffload_hf.__version__, torch.__version__, transformers.__version__, sys.version],
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": described,
        "tensors": [
            (name, tuple(tensor.shape), str(tensor.dtype))
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        ],
        # dynamo does not guard on empty hook dicts (``skip_nnmodule_hook_guards``): a hook added since
        # would not be called by a graph saved without it
        "hooks": _hook_counts(model),
        "entry": entry,
        "device": config.device.type,
        "budgets": [config.gpu_memory, config.cpu_memory],
        "capture": config.capture,
        "compile": config.compile,
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _hook_counts(model: nn.Module) -> list[tuple[str, list[int]]]:
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    counts = [(name, [len(getattr(m, kind, ())) for kind in kinds]) for name, m in model.named_modules()]
    hooks = torch.nn.modules.module
    global_counts = [len(hooks._global_forward_hooks), len(hooks._global_forward_pre_hooks)]
    return [(name, c) for name, c in counts if any(c)] + [("<global>", global_counts)]


@contextmanager
def running(engine: Engine) -> Iterator[None]:
    """Saved graphs called now run with ``engine``."""
    token = _RUNNING.set(engine)
    try:
        yield
    finally:
        _RUNNING.reset(token)


class SavedGraph(BackendCacheArtifact[Any]):
    """One captured graph of an entry, as saved: installed as a ``LoadedGraph``."""

    def after_deserialization(self) -> LoadedGraph:
        return LoadedGraph(self.content)


class LoadedGraph:
    """What dynamo calls for a graph installed from the cache: the running engine's entry for it, made
    at its first call with that call's arguments (as the engine is given a captured graph's), or, called
    outside any offloaded model, the graph itself. The graph is read from its bytes at its first call (a
    process may install graphs it never calls: a kind of call it does not make).

    One graph can serve several modules' frames: the saved guards do not hold identities, so a frame
    resumed after a graph break (the same code in every layer) passes the guards of the graph captured
    for the first layer. Its weights are the call's arguments, so the engine is given the graph once for
    each set of weights it is called with (each layer's), as dynamo captured it once for each."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._graph: fx.GraphModule | None = None  # read, not yet given to an engine
        self._weights: list[int] | None = None  # the positions of the arguments that are parameters

    def _read(self) -> fx.GraphModule:
        graph, self._graph = self._graph, None
        return graph if graph is not None else dynamo_package.graph_from_bytes(self._data)

    def __call__(self, *args: Any) -> Any:
        engine = _RUNNING.get()
        if engine is None:
            self._graph = self._read()
            return self._graph(*args)
        if self._weights is None:
            self._weights = [i for i, arg in enumerate(args) if isinstance(arg, nn.Parameter)]
        # kept by the engine, not here: installed graphs live as long as the process, engines do not
        key = (self, *(id(args[i]) for i in self._weights))
        entry = engine.installed_graphs.get(key)
        if entry is None:
            entry = engine.installed_graphs[key] = engine(self._read(), list(args))
        return entry(*args)


class EntryCache:
    """The cache entry of one entry point of one model: installed before its first capture, saved after
    each call that captured a graph."""

    def __init__(self, folder: Path, key: Callable[[], str], label: str) -> None:
        self._root = folder
        self._key = key  # read at the first capture: hooks added after offloading count
        self.label = label  # for messages: the model's class and entry point
        self._store = DiskDynamoStore(str(folder))
        self.package: dynamo_package.CapturingPackage | None = None
        self.loaded = 0  # graphs installed from disk
        self._unsaved = 0  # graphs captured since the entry was last saved
        self._failed = False  # saving failed once: not tried again in this process

    @functools.cached_property
    def key(self) -> str:
        return self._key()

    @property
    def folder(self) -> Path:
        return self._root / self.key

    def package_for(self, fn: Callable[..., Any]) -> dynamo_package.CapturingPackage:
        """``fn``'s package: the saved entry installed where there is a usable one, else an empty one."""
        if self.package is None and (self.folder / "entry").is_file():
            try:
                saved = self._store.load_cache_entry(self.key)
                missing = dynamo_package.missing_graph(saved.dynamo, saved.backends)
                if missing:
                    raise ValueError(missing)
                names_file = self.folder / _GLOBALS_FILE
                names = json.loads(names_file.read_text()) if names_file.is_file() else {}
                self.package = dynamo_package.installed_package(fn, saved.dynamo, saved.backends, names)
                self.loaded = len(saved.backends)
                report("%s: %d graphs from the compile cache (%s)", self.label, self.loaded, self.folder)
            except Exception as exc:  # noqa: BLE001 - never trusted: any failure means capture anew
                warn(
                    "%s: compile cache entry %s cannot be used (%s: %s); removed, the call is captured anew",
                    self.label,
                    self.folder,
                    type(exc).__name__,
                    exc,
                )
                shutil.rmtree(self.folder, ignore_errors=True)
        if self.package is None:
            self.package = dynamo_package.new_package(fn)
        return self.package

    def backend(self, engine: Callable[..., Any]) -> Callable[[fx.GraphModule, list[Any]], Any]:
        """The backend dynamo captures into: each graph recorded for the entry, then given to ``engine``
        (the engine, as a ``torch.compile`` backend)."""

        def record(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
            data = None
            if not self._failed:
                try:
                    data = dynamo_package.graph_bytes(gm)  # as dynamo gave it: the engine rewrites it
                except Exception as exc:  # noqa: BLE001 - a graph that does not save: the entry is not saved
                    self._give_up("a graph could not be saved", exc)
            entry = engine(gm, example_inputs)  # a graph the budget refuses is not recorded
            if data is not None:
                PrecompileContext.record_artifact(SavedGraph(key=str(gm._backend_id), content=data))
                self._unsaved += 1
            return entry

        return record

    def save(self) -> None:
        """Write the entry where graphs were captured since it was last written."""
        if not self._unsaved or self._failed or self.package is None:
            return
        try:
            entry = self.package.saved_entry()
            self.folder.mkdir(parents=True, exist_ok=True)
            names = dynamo_package.module_globals(self.package)
            _write_atomically(self.folder / _GLOBALS_FILE, lambda f: f.write(json.dumps(names).encode()))
            backends = {
                backend: PrecompileContext.serialize_artifact_by_key(backend)
                for code in entry.codes
                for backend in code.backend_ids
            }
            saved = PrecompileCacheEntry(dynamo=entry, backends=backends)
            # streamed to the file: dynamo's own store pickles to bytes first, and keeps a copy of them
            _write_atomically(self.folder / "entry", lambda f: pickle.dump(saved, f))
        except Exception as exc:  # noqa: BLE001 - the cache is an optimisation: the run goes on without it
            self._give_up("it could not be written", exc)
            return
        report("%s: %d graphs saved in the compile cache (%s)", self.label, self._unsaved, self.folder)
        self._unsaved = 0

    def _give_up(self, why: str, exc: Exception) -> None:
        self._failed = True
        warn("%s: not saved in the compile cache: %s (%s: %s)", self.label, why, type(exc).__name__, exc)


def _write_atomically(path: Path, write: Callable[[Any], Any]) -> None:
    """Write ``path`` through ``write(file)`` into a file beside it, then rename it into place: a reader
    sees the old file or the whole new one."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            write(file)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
