"""What the engine gives dynamo for each captured graph: the callable that runs it. Its first call is
profiled; each call's activations are measured first and the plan remade where they outgrow it; a call
made inside a block of calls (``cohort``) waits at the graph and runs with the others waiting there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from fxoffload_hf.activations import ActivationModel
from fxoffload_hf.kv_disk import on_disk, paged_out_bytes, resident_bytes
from fxoffload_hf.observers import Profiler
from fxoffload_hf.runner import GraphRunner

if TYPE_CHECKING:
    from fxoffload_hf.engine import Engine


class GraphEntry:
    """What the backend returns for a graph: its first call is profiled, later calls just run."""

    def __init__(
        self, engine: Engine, runner: GraphRunner, activations: ActivationModel, inputs: tuple[int, ...]
    ) -> None:
        self.engine = engine
        self.runner = runner
        self.activations = activations
        self.inputs = inputs  # positions of the arguments that are the call's own tensors (not weights)
        self._call = self._profiled_call

    def __call__(self, *args: Any) -> Any:
        self.engine.captures.progress.ran(self.runner.index)
        cohort = self.engine.cohort
        if cohort is not None and cohort.is_member():
            return cohort.wait_at(self, args)
        return self._call_one(args)

    def _call_one(self, args: tuple[Any, ...], held: int = 0) -> Any:
        need = self.activations(args) + held - self._paged_out(args)
        if need > self.engine.activation_bytes[self.runner.index]:
            self.engine.activations_grew(self.runner.index, need)
        return self._call(args)

    def _own_tensors(self, args: tuple[Any, ...]) -> list[torch.Tensor]:
        return [t for i in self.inputs if isinstance(t := args[i], torch.Tensor)]

    def _paged_out(self, args: tuple[Any, ...]) -> int:
        """What the activation model overstates for a KV cache the call keeps on disk (``kv_disk``)."""
        return paged_out_bytes(self._own_tensors(args))

    def input_bytes(self, calls: list[tuple[Any, ...]]) -> int:
        """Bytes of the tensors ``calls`` pass of their own (a KV cache, ids), each storage once; of a KV
        cache on disk, the part in memory at a time."""
        storages: dict[int, int] = {}
        resident = 0
        for args in calls:
            paged = []
            for tensor in self._own_tensors(args):
                if on_disk(tensor):
                    paged.append(tensor)
                else:
                    storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            resident += resident_bytes(paged)
        return sum(storages.values()) + resident

    def call_together(self, calls: list[tuple[Any, ...]], held: int) -> list[Any]:
        """Run the graph for the first of ``calls`` (a block's members waiting here) in one pass over the
        pieces, as many as fit together: their results, in order; the rest wait for a later run, holding
        their arguments, beside ``held`` bytes of calls waiting elsewhere. A graph's first call runs
        alone (it is profiled); the calls that run are halved until their activations fit."""
        engine, runner = self.engine, self.runner

        def need_for(count: int) -> int:  # the first ``count`` run, the rest wait holding their arguments
            return held + self.input_bytes(calls[count:]) + sum(self.activations(a) for a in calls[:count])

        count = 1 if self._call == self._profiled_call else len(calls)
        need = need_for(count)
        while count > 1 and not engine.fits_activations(need):
            count //= 2
            need = need_for(count)
        if count == 1:
            return [self._call_one(calls[0], need - self.activations(calls[0]))]
        if need > engine.activation_bytes[runner.index]:
            engine.activations_grew(runner.index, need)
        engine.current()
        results = runner.run_block(calls[:count])
        engine.called(runner, count)
        return results

    def _profiled_call(self, args: tuple[Any, ...]) -> Any:
        engine, runner = self.engine, self.runner
        device = engine.device
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        profiler = Profiler(engine.weight_sizes, sync)
        engine.capture_finished()
        engine.current()
        runner.observers = (*engine.observers, profiler)
        engine.loader.time_copies = True
        try:
            result = runner(*args)
        finally:
            runner.observers = engine.observers
            engine.loader.time_copies = False
        engine.called(runner)
        engine.profiled(runner, profiler.profile)
        self._call = self._steady_call
        return result

    def _steady_call(self, args: tuple[Any, ...]) -> Any:
        self.engine.current()
        result = self.runner(*args)
        self.engine.called(self.runner)
        return result
