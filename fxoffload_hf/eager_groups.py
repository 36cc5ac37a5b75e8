"""The mapped group each module's eager call is lent, kept per module while its weights stay where they are.

An eager call lends weights whose file bytes can serve as they lie (the CPU) as views of the file's pages,
one ``MappedGroup`` per module (``EagerWeights._values``); making a group costs a look at each file and the
pages' units, so a module's is kept for its next call, and for a read ahead of that call
(``eager_read_ahead``). A group is made again when the module's sources change (a weight moved between
tiers) or its files were replaced.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from fxoffload_hf.eager_sizes import record_of
from fxoffload_hf.mapped_io import MappedFiles, MappedGroup
from fxoffload_hf.safetensors_io import CheckpointError, TensorSlice


class ModuleGroups:
    """Per module, the mapped group of the weights its eager call is lent in place."""

    def __init__(self, files: MappedFiles) -> None:
        self.files = files
        self._groups: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[TensorSlice, ...], MappedGroup]] = (
            weakref.WeakKeyDictionary()
        )
        # modules none of whose weights are lent in place, by the store's version they were seen at
        self._without: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

    def of(self, module: nn.Module, ghosts: list[nn.Parameter]) -> MappedGroup:
        """The group of ``ghosts``, ``module``'s weights lent in place now: the one kept if it maps them.

        Raises:
            CheckpointError: a file of theirs is missing or changed (``MappedFiles.group``).
        """
        sources = tuple(record_of(ghost).disk for ghost in ghosts)
        cached = self._groups.get(module)
        if cached is not None and cached[0] == sources and self.files.is_current(cached[1]):
            return cached[1]
        # a table read by lookups is not faulted in whole: its rows fault in as they are read
        fault_in = [not isinstance(module, nn.Embedding)] * len(sources)
        group = self.files.group(list(sources), fault_in)  # type: ignore[arg-type]
        self._groups[module] = (sources, group)  # type: ignore[assignment]
        return group

    def ahead(
        self, module: nn.Module, version: int, in_place: Callable[[], list[nn.Parameter]]
    ) -> MappedGroup | None:
        """The group ``module``'s next call will be lent, to read ahead: its last call's, or, before its
        first, the one of ``in_place()`` (its ghosts it will be lent in place); None where it lends none
        in place (at the store's ``version``: until weights move) or where the group cannot be made (a
        guess fails no call: the module's own call names its file's fault, if it runs)."""
        cached = self._groups.get(module)
        if cached is not None:
            return cached[1]
        if self._without.get(module) == version:
            return None
        ghosts = in_place()
        if not ghosts:
            self._without[module] = version
            return None
        try:
            return self.of(module, ghosts)
        except (CheckpointError, OSError):
            return None
