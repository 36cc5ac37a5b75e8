"""The mapped group each module's eager call is lent, kept per module while its weights stay where they are.

An eager call lends weights whose file bytes can serve as they lie (the CPU) as views of the file's pages,
one ``MappedGroup`` per module (``EagerWeights._values``); making a group costs a look at each file and the
pages' units, so a module's is kept for its next call, and for a read ahead of that call
(``eager_read_ahead``). A group is made again when the module's sources change (a weight moved between
tiers) or its files were replaced.
"""

from __future__ import annotations

import weakref

from torch import nn

from fxoffload_hf.mapped_io import MappedFiles, MappedGroup
from fxoffload_hf.safetensors_io import TensorSlice


class ModuleGroups:
    """Per module, the mapped group of the weights its eager call is lent in place."""

    def __init__(self, files: MappedFiles) -> None:
        self.files = files
        self._groups: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[TensorSlice, ...], MappedGroup]] = (
            weakref.WeakKeyDictionary()
        )
        # modules none of whose weights were lent in place, by the store's version they were seen at
        self._without: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()

    def of(self, module: nn.Module, sources: tuple[TensorSlice, ...]) -> MappedGroup:
        """The group of ``sources``, ``module``'s weights lent in place now: the one kept if it maps them.

        Raises:
            CheckpointError: a file of ``sources`` is missing or changed (``MappedFiles.group``).
        """
        cached = self._groups.get(module)
        if cached is not None and cached[0] == sources and self.files.is_current(cached[1]):
            return cached[1]
        # a table read by lookups is not faulted in whole: its rows fault in as they are read
        fault_in = [not isinstance(module, nn.Embedding)] * len(sources)
        group = self.files.group(list(sources), fault_in)
        self._groups[module] = (sources, group)
        return group

    def last(self, module: nn.Module) -> MappedGroup | None:
        """The group ``module``'s last call was lent, if any."""
        cached = self._groups.get(module)
        return None if cached is None else cached[1]

    def none_at(self, module: nn.Module, version: int) -> bool:
        """Whether ``module`` was seen to lend nothing in place at the store's ``version``."""
        return self._without.get(module) == version

    def note_none(self, module: nn.Module, version: int) -> None:
        """Note that ``module`` lends nothing in place at the store's ``version`` (until weights move)."""
        self._without[module] = version
