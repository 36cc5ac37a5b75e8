"""Dynamo's packages (``torch._dynamo.package``: a frame's transformed bytecode, its guards and its graphs'
compiled functions, saved and installed in another process), made to hold what fxoffload captures.

Each adaptation here answers one thing torch 2.13's packaging cannot yet save or restore, found on
Transformers' models (``tests/test_compile_cache.py``):

- guards on identities and on closure contents (an object's ``id`` differs in the next process; dynamo
  drops the former itself under ``caching_precompile``; fxoffload's wrappers hold the closures) and on
  which hook a module holds (hooks are keyed by a process-wide counter; how many it holds is still
  guarded) are not saved: the cache is keyed by the model, the library and torch versions, and dynamo
  checks the traced source files' hashes at install. The process that captures checks every guard, as
  without a package. Without identity guards a frame resumed after a graph break (one code in every
  layer) is served the graph captured for the first layer, which ``compile_cache.LoadedGraph`` gives the
  engine once per set of weights it is called with (found on a Llama broken in every MLP: served whole,
  the first layer's weights ran in every layer);
- guards on objects of classes defined inside functions (Transformers' kernel-function modules) cannot
  be pickled: not saved either;
- the guard state's pickler meets fxoffload's own hooks and wrappers on the model's modules: what no
  guard reads becomes dynamo's ``_Missing``, a bound method of ours a method of an empty instance, a
  function that its qualified name does not find (a decorated forward's inner function) is rebuilt
  from its code;
- a guard state that still fails to pickle bypasses the package for that frame (torch asserts instead);
- a decorated function's frame runs in the globals of the decorator's module, which the package does not
  know (it installs into the function's ``__module__``), nor the globals dynamo names after a module's id;
- after an install, a new capture could reuse a global name the package installed (``unique_id``).

A captured graph is saved with ``GraphPickler`` (its nodes' traced values, symbolic sizes included);
graphs' nodes keep only the metadata fxoffload reads.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import re
import sys
import tempfile
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx
from torch._dynamo import bytecode_transformation, guards
from torch._dynamo.exc import PackageError
from torch._dynamo.package import CompilePackage, SerializedCode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import _graph_pickler
from torch.fx.experimental.symbolic_shapes import ShapeEnv

_OURS = "fxoffload_hf"
# node metadata kept in a saved graph: what fxoffload reads (``graphs``, ``plan_depth``); not the source
# lines each node came from (``stack_trace``: 72% of a tiny Llama's graph bytes)
_KEPT_META = ("example_value", "val", "nn_module_stack")
_INSTALLED_NAME = re.compile(r"_(\d+)$")
# a module's hook read by its id (``_forward_hooks_always_called[15]``): ids count hooks made in a process
_BY_HOOK_ID = re.compile(r"_hooks\w*\[\d+\]")
# a function's names: guarded where a decorator builds a message of them; the same source, the same names
_NAMES = (".__name__", ".__qualname__")


def guard_filter(entries: Sequence[Any]) -> list[bool]:
    """Which of a frame's guards are saved with a package, to be checked in the next process (see the
    module's notes)."""
    unsaved = set(guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    kept = []
    for entry in entries:
        local_type = (
            entry.guard_type in ("TYPE_MATCH", "BUILTIN_MATCH")
            and entry.has_value
            and "<locals>" in type(entry.value).__qualname__
        )
        kept.append(
            entry.guard_type not in unsaved
            and not unsaved.intersection(entry.derived_guard_types)
            and not local_type
            and "__closure__" not in entry.name
            and not (entry.guard_type == "DICT_CONTAINS" and "_hooks" in entry.name)
            and not _BY_HOOK_ID.search(entry.name)
            and not entry.name.endswith(_NAMES)
        )
    return kept


@contextmanager
def saving_guards() -> Iterator[None]:
    """While frames are captured into a package: the guards saved are those ``guard_filter`` keeps (the
    running process checks them all, as without a package), the guard state's pickler is taught
    fxoffload's objects, and a guard state that cannot be saved bypasses the package instead of failing
    the capture."""
    pickler = guards.GuardsStatePickler
    reduce, serialize = pickler.reducer_override, guards.CheckFunctionManager.serialize_guards

    def reducer_override(self: Any, obj: Any) -> Any:
        if inspect.ismethod(obj) and type(obj.__self__).__module__.startswith(_OURS):
            return _method_of_empty, (obj.__func__, type(obj.__self__))
        if _ours(obj) and id(obj) not in self.guard_tree_values:
            return guards._Missing, ("fxoffload_hf",)
        if inspect.isfunction(obj) and "<locals>" not in obj.__qualname__ and not _found_by_name(obj):
            return _function, (
                obj.__code__,
                obj.__module__,
                obj.__name__,
                obj.__qualname__,
                obj.__defaults__,
                obj.__kwdefaults__,
                obj.__closure__,
            )
        try:
            return reduce(self, obj)
        except AttributeError:  # a bound method its object no longer has (``nn.Module``'s stand-in forward)
            return guards._Missing, ("unreadable",)

    def serialize_guards(self: Any, builder: Any, sorted_guards: Any, output_graph: Any) -> bytes:
        try:
            entries = [guards.make_guard_filter_entry(guard, builder) for guard in sorted_guards]
            saved = [guard for guard, keep in zip(sorted_guards, guard_filter(entries), strict=True) if keep]
            return serialize(self, builder, saved, output_graph)
        except Exception as exc:  # noqa: BLE001 - any failure: this frame is not saved, the capture goes on
            output_graph.bypass_package(f"fxoffload_hf: guards not saved: {exc}")
            return b""

    pickler.reducer_override = reducer_override  # type: ignore[method-assign]
    guards.CheckFunctionManager.serialize_guards = serialize_guards  # type: ignore[method-assign]
    try:
        yield
    finally:
        pickler.reducer_override = reduce  # type: ignore[method-assign]
        guards.CheckFunctionManager.serialize_guards = serialize  # type: ignore[method-assign]


def _ours(obj: Any) -> bool:
    """Whether ``obj`` is fxoffload's and found by no name (an instance, a closure): not picklable."""
    if isinstance(obj, (type, torch.nn.Module)) or (inspect.isfunction(obj) and _found_by_name(obj)):
        return False
    module = getattr(obj, "__module__", None) if callable(obj) else type(obj).__module__
    return isinstance(module, str) and module.startswith(_OURS)


def _found_by_name(function: types.FunctionType) -> bool:
    found: Any = sys.modules.get(function.__module__)
    for name in function.__qualname__.split("."):
        found = getattr(found, name, None)
    return found is function


def _function(
    code: types.CodeType,
    module: str,
    name: str,
    qualname: str,
    defaults: tuple[Any, ...] | None,
    kwdefaults: dict[str, Any] | None,
    closure: tuple[types.CellType, ...] | None,
) -> types.FunctionType:
    function = types.FunctionType(code, importlib.import_module(module).__dict__, name, defaults, closure)
    function.__qualname__ = qualname
    function.__kwdefaults__ = kwdefaults
    return function


def _method_of_empty(function: Callable[..., Any], cls: type[Any]) -> types.MethodType:
    return types.MethodType(function, object.__new__(cls))


class CapturingPackage(CompilePackage):
    """A package that remembers the frames whose capture raised (the budget refused a graph, an
    interrupt): dynamo leaves such a frame without captured code, as it leaves a frame it chose to skip,
    and installed that way it would be skipped in the next process: run as plain eager code, on ghosts,
    where this process captured it anew at its next call and ran it eagerly from the entry point.

    It also captures frames of code it does not hold: dynamo's compiled code is shared by every model
    of a class in a process, so a model's call can resume in a function another entry made (the same
    model offloaded at another budget before, whose entry was installed or captured here); torch's
    package refuses such a frame (it cannot name its source). Captured as usual, it is not saved; where
    this package later makes the same resume function itself (dynamo reuses its code), it is saved
    bypassed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.failed: set[types.CodeType] = set()
        self._foreign: set[types.CodeType] = set()

    @contextmanager
    def code_context(self, code: types.CodeType) -> Iterator[None]:
        if code not in self._codes:
            try:
                self._add_user_function(code)
            except PackageError:
                module = inspect.getmodule(code)
                self._add_function(code, module.__name__ if module else "__main__")
                self._codes[code].bypassed = True
                self._foreign.add(code)
        with super().code_context(code):
            try:
                yield
            except BaseException:
                self.failed.add(code)
                raise

    def add_resume_function(
        self, python_code: types.CodeType, python_module: str, function_name: str
    ) -> None:
        foreign = python_code in self._foreign
        if foreign:
            del self._codes[python_code]  # recorded as another entry's: now this one's, to install
            self._foreign.discard(python_code)
        super().add_resume_function(python_code, python_module, function_name)
        if foreign:
            self._codes[python_code].bypassed = True  # its captures so far were not recorded

    def saved_entry(self) -> Any:
        """The package's entry to save: a frame whose capture failed and that holds no captured code is
        saved bypassed (installed, dynamo captures it anew), not skipped."""
        entry = self.cache_entry()
        failed = {id(self._codes[code]) for code in self.failed}
        foreign = {id(self._codes[code]) for code in self._foreign}
        codes = [
            dataclasses.replace(code, bypassed=True)
            if id(code) in failed and not code.guarded_codes
            else code
            for code in entry.codes
            if id(code) not in foreign
        ]
        return dataclasses.replace(entry, codes=codes)


def missing_graph(entry: Any, backends: dict[Any, Any]) -> str | None:
    """Why a saved entry cannot be installed as it stands: a graph its frames name that was not saved
    with it; else None."""
    for code in entry.codes:
        if not code.bypassed and any(backend not in backends for backend in code.backend_ids):
            return f"a graph of {entry.fn_name} was not saved with it"
    return None


def new_package(fn: Callable[..., Any]) -> CapturingPackage:
    """An empty package for ``fn``'s frame, installing into the globals its code runs in."""
    package = CapturingPackage(fn)
    _run_in_code_globals(package, fn)
    return package


def installed_package(
    fn: Callable[..., Any], dynamo: Any, backends: dict[Any, Any], names: dict[str, str]
) -> CapturingPackage:
    """``fn``'s package from a saved entry, installed: its frames run the saved code and graphs where the
    guards pass. ``names`` are the module globals the code reads (``module_globals``). Raises where the
    entry does not fit this process (versions, changed source files); nothing stays installed then."""
    package = CapturingPackage(fn, dynamo)
    _run_in_code_globals(package, fn)
    try:
        for key, module_name in names.items():
            module, name = key.split(":", 1)
            sys.modules[module].__dict__[name] = importlib.import_module(module_name)
        package.install(backends)
    except BaseException:
        package.uninstall()
        _skip_installed_ids(package)  # what the install named without recording it stays (a builtins dict)
        raise
    _skip_installed_ids(package)
    return package


def _run_in_code_globals(package: CompilePackage, fn: Callable[..., Any]) -> None:
    function = getattr(fn, "__func__", fn)
    package._codes[function.__code__].python_module = function.__globals__["__name__"]


def module_globals(package: CompilePackage) -> dict[str, str]:
    """The modules the package's code reads by names dynamo made of their ids (``module:name`` → the
    module's import name): not saved by the package, installed from this by ``installed_package``."""
    found: dict[str, str] = {}
    for entry in package._codes.values():
        scope = sys.modules[entry.python_module].__dict__
        for guarded in entry.guarded_codes:
            for name in _names(SerializedCode.to_code_object(guarded.dynamo_code)):
                value = scope.get(name)
                if name.startswith("___module_") and isinstance(value, types.ModuleType):
                    found[f"{entry.python_module}:{name}"] = value.__name__
    return found


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _skip_installed_ids(package: CompilePackage) -> None:
    """Advance dynamo's unique-name counter past the names the install put in module globals."""
    highest = -1
    for entry in package._codes.values():
        for name in sys.modules[entry.python_module].__dict__:
            match = _INSTALLED_NAME.search(name) if name.startswith("__") else None
            if match:
                highest = max(highest, int(match.group(1)))
    current = int(re.sub(r"\D", "", repr(bytecode_transformation._unique_id_counter)) or 0)
    if highest >= current:
        bytecode_transformation._unique_id_counter = itertools.count(highest + 1)


class _TensorData(_graph_pickler._TensorPickleData):
    """A traced value, its view's base without its fake mode as well (torch keeps it: unpicklable)."""

    def __init__(self, describer: Any, tensor: torch.Tensor) -> None:
        super().__init__(describer, tensor)
        base = self.metadata.base
        if base is not None:
            self.metadata = dataclasses.replace(self.metadata, base=dataclasses.replace(base, fake_mode=None))


class _GraphPickler(_graph_pickler.GraphPickler):
    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, FakeTensor):
            return _TensorData.reduce_helper(self, obj)
        return super().reducer_override(obj)


def graph_bytes(gm: fx.GraphModule) -> bytes:
    """``gm`` as dynamo gave it, as bytes: its code, its nodes' traced values and module paths."""
    metas = {node: node.meta for node in gm.graph.nodes}
    try:
        for node, meta in metas.items():
            kept = {key: meta[key] for key in _KEPT_META if key in meta}
            if "nn_module_stack" in kept:  # module classes defined in functions do not pickle: named
                kept["nn_module_stack"] = {
                    key: (path, getattr(cls, "__qualname__", str(cls)))
                    for key, (path, cls) in kept["nn_module_stack"].items()
                }
            node.meta = kept
        plain = fx.GraphModule(gm, gm.graph)  # without dynamo's attributes (sources, weak references)
        # through a file, read back in one allocation: a growing in-memory stream would hold up to three
        # times the graph's bytes at once, outside the budget
        with tempfile.TemporaryFile() as file, _graph_pickler.patch_pytree_map_over_slice():
            _GraphPickler(file, _graph_pickler.Options(ops_filter=None)).dump(plain)  # type: ignore[arg-type]
            file.seek(0)
            return file.read()
    finally:
        for node, meta in metas.items():
            node.meta = meta


def graph_from_bytes(data: bytes) -> fx.GraphModule:
    """A graph saved by ``graph_bytes``; its symbolic sizes in a shape environment of their own."""
    gm = _GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv()))
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"not a saved graph: {type(gm).__name__}")
    gm.recompile()  # its code, from its graph
    return gm
