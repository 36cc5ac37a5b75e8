"""What an eager call of a module is lent (``eager_fallback``): its ghosts, and which of their weights it
uses whole, with their bytes; not a table it reads by rows where the table lies, nor a projection's
weight it computes with in tiles (``eager_tiles``)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fxoffload_hf.capture import handle_of
from fxoffload_hf.eager_forwards import reads_rows
from fxoffload_hf.loaders import ROWS_WHERE_THEY_LIE, Way
from fxoffload_hf.weight_record import WeightRecord


def whole_bytes(module: nn.Module, ghosts: list[nn.Parameter], ways: list[Way], tile: int) -> int:
    """Bytes an eager call brings in whole: not the kept weights, nor a table read by rows where it lies
    (host RAM, or its file's pages, faulted in by the rows read); ``tile``: what one tile of a weight
    computed in tiles holds (0: none is)."""
    used = weights_used_whole(module, ghosts, ways, tile > 0)
    return sum(record.footprint for record, way in used if way is not Way.HELD) + tile


def weights_used_whole(
    module: nn.Module, ghosts: list[nn.Parameter], ways: list[Way], tiled: bool
) -> list[tuple[WeightRecord, Way]]:
    """The weights an eager call of ``module`` uses whole, with the way each comes: not a table it reads
    rows of where the table lies, nor a weight it computes with in tiles (``tiled``)."""
    weight = module._parameters.get("weight")
    return [
        (record_of(g), way)
        for g, way in zip(ghosts, ways, strict=True)
        if not _read_by_rows(module, g, way) and not (tiled and g is weight)
    ]


def tables_read_by_rows(module: nn.Module, ghosts: list[nn.Parameter], ways: list[Way]) -> list[WeightRecord]:
    """The tables an eager call of ``module`` reads rows of where they lie (never brought in whole)."""
    return [record_of(g) for g, way in zip(ghosts, ways, strict=True) if _read_by_rows(module, g, way)]


def _read_by_rows(module: nn.Module, ghost: nn.Parameter, way: Way) -> bool:
    return way in ROWS_WHERE_THEY_LIE and reads_rows(module, ghost.device.type)


def record_of(ghost: nn.Parameter) -> WeightRecord:
    handle = handle_of(ghost)
    assert handle is not None
    return handle.record


def lent_ghosts(module: nn.Module, children: Iterable[nn.Module] = ()) -> list[nn.Parameter]:
    """The ghosts an eager call of ``module`` is lent: its own, and those of ``children``, the children
    it reads without calling them (``direct_reads``)."""
    ghosts = own_ghosts(module)
    for child in children:
        ghosts.extend(g for g in own_ghosts(child) if all(g is not h for h in ghosts))
    return ghosts


def own_ghosts(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module._parameters.values() if p is not None and handle_of(p) is not None]
