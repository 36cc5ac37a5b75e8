"""What a GPU run holds in host RAM, within ``cpu_memory``: weights read into RAM (copied to the device
from pinned memory instead of read from their files at each use) and, beside them, the state of each
captured graph, which lies in host memory whatever the device.

At load, weights fill what ``cpu_memory`` leaves (``api``); each captured graph then takes its state
out of that room (``Engine``), and ``fit_host`` lets go of weights to make it: first host copies of
weights that also lie in a file (the last read first; nothing is written, they stream from the file
again), then weights only RAM holds, spilled to the offload folder.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from fxoffload_hf.weights import WeightStore


def read_into_ram(store: WeightStore, room: int) -> int:
    """Read weights that only a file holds into host RAM while they fit in ``room`` bytes, in the model's
    order; the bytes read. For a GPU: a weight in RAM is copied to the device from pinned memory, at the
    link's speed, instead of read from its file (and staged) for every use. The file range stays known,
    so dropping the copy needs no write (``fit_host``)."""
    todo, used = [], 0
    for record in store.weights():
        if record.disk is None or record.host is not None or record.resident is not None:
            continue
        if used + record.nbytes <= room:
            todo.append(record)
            used += record.nbytes
    with tqdm(
        total=used, desc="Reading weights into RAM", unit="B", unit_scale=True, disable=not used
    ) as bar:
        for record in todo:
            assert record.disk is not None
            record.host = store.read_source(record.disk, record.dtype)
            bar.update(record.nbytes)
    if used:
        store.version += 1
    return used


def fit_host(store: WeightStore, room: int, folder: Path | None) -> int:
    """Hold at most ``room`` bytes of weights in host RAM; the bytes let go.

    Raises:
        OSError: weights only RAM holds cannot be written to the offload folder.
    """
    over = store.ram_bytes() - room
    if over <= 0:
        return 0
    if store.device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(store.device)  # copies from these host tensors may still be in flight
    freed = 0
    in_ram = [r for r in reversed(store.weights()) if r.host is not None]
    for record in [r for r in in_ram if r.disk is not None]:
        if freed >= over:
            return freed
        store.drop_host(record.name)
        freed += record.nbytes
    spilled = []
    for record in [r for r in in_ram if r.disk is None]:
        if freed >= over:
            break
        spilled.append(record.name)
        freed += record.nbytes
    if spilled:
        store.spill(spilled, store.spill_folder(folder))
    return freed
