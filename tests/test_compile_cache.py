"""compile_cache and dynamo_package: what dynamo captured of a model, saved and installed in the next
process; a bad entry ignored; the key; graphs as bytes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import fx

import fxoffload_hf
from fxoffload_hf import compile_cache, dynamo_package
from fxoffload_hf.config import OffloadConfig

_CHILD = Path(__file__).with_name("compile_cache_child.py")
_BUDGET = 300_000  # forces tiles and many pieces on the tiny Llama


def _run_child(checkpoint: Path, cache: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run(
        [
            sys.executable,
            str(_CHILD),
            str(checkpoint),
            str(cache),
            str(_BUDGET),
            str(out),
            str(torch.get_num_threads()),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(str(out) + ".pt"), json.loads(Path(str(out) + ".json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("breaks", [(), ("break-mlp",)], ids=["whole", "graph-breaks"])
def test_a_second_process_runs_the_saved_graphs_without_capturing_and_exactly(llama_ckpt, tmp_path, breaks):
    """Whole, each call is one frame; with a graph break in every MLP, each layer's MLP is resumed from
    the same code, and the saved graph of the first layer's is served to every layer: run with each
    layer's own weights."""
    folder, eager = llama_ckpt
    cache = tmp_path / "cache"
    first, first_stats = _run_child(folder, cache, tmp_path / "first", *breaks)
    entries = list(cache.glob("*/entry"))
    assert len(entries) == 1
    second, second_stats = _run_child(folder, cache, tmp_path / "second", *breaks)

    ids = torch.tensor([[0, 0, 5, 9, 13, 4], [3, 7, 11, 2, 8, 6]])
    with torch.no_grad():
        tokens = eager.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=4, do_sample=False)
        logits = eager(ids[1:, :5]).logits
    for run in (first, second):
        assert breaks or torch.equal(run["tokens"], tokens)
        assert torch.equal(run["logits"], logits)
    assert first_stats["captured"] >= 3  # prefill, decode and the plain call; or the plain call's frames
    assert second_stats["captured"] == 0  # every call ran graphs installed from the cache


def _offloaded_logits(model, ids, cache, before=lambda: None):
    """``model``'s logits for ``ids``, offloaded with the compile cache ``cache`` (``before()`` is called
    after offloading, before the call: its result is returned beside the logits), then restored."""
    fxoffload_hf.offload(model, cpu_memory=600_000, device="cpu", compile_cache=cache)
    try:
        ready = before()
        with torch.no_grad():
            return model(ids).logits, ready
    finally:
        fxoffload_hf.restore(model)


def test_a_corrupt_entry_is_removed_and_the_call_captured_anew(tiny, example_input, tmp_path, report_lines):
    model = tiny("llama")
    ids = example_input(model)
    with torch.no_grad():
        expected = model(ids).logits
    cache = tmp_path / "cache"

    def corrupt_entry() -> str:
        key = compile_cache.entry_key(model, "forward", fxoffload_hf.engine_of(model).config)
        (cache / key).mkdir(parents=True)
        (cache / key / "entry").write_bytes(b"not a pickle")
        return key

    got, key = _offloaded_logits(model, ids, cache, corrupt_entry)
    assert torch.equal(got, expected)
    assert any("cannot be used" in line and "captured anew" in line for line in report_lines), report_lines
    # the fresh capture is saved in its place
    assert (cache / key / "entry").read_bytes() != b"not a pickle"


def test_the_key_changes_with_what_shapes_the_capture(tiny):
    model = tiny("llama")
    config = OffloadConfig.build(cpu_memory=200_000, device="cpu")
    key = compile_cache.entry_key(model, "forward", config)
    assert key == compile_cache.entry_key(tiny("llama"), "forward", config)
    assert key != compile_cache.entry_key(
        model, "forward", OffloadConfig.build(cpu_memory=300_000, device="cpu")
    )
    assert key != compile_cache.entry_key(model, "model.encoder.forward", config)
    assert key != compile_cache.entry_key(tiny("llama", num_hidden_layers=3), "forward", config)
    assert key != compile_cache.entry_key(tiny("llama").to(torch.bfloat16), "forward", config)
    hooked = tiny("llama")
    hooked.model.layers[0].register_forward_hook(lambda module, args, out: None)
    assert key != compile_cache.entry_key(hooked, "forward", config)


def test_the_cache_folder_comes_from_the_keyword_then_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compile_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.resolve_cache_dir(None) == tmp_path / "fxoffload_hf" / "compiled"
    # left to its default, off under a host-memory budget; asked for, on
    assert compile_cache.resolve_cache_dir(None, host_budget=True) is None
    assert compile_cache.resolve_cache_dir(True, host_budget=True) == tmp_path / "fxoffload_hf" / "compiled"
    assert compile_cache.resolve_cache_dir(True) == tmp_path / "fxoffload_hf" / "compiled"
    assert compile_cache.resolve_cache_dir(False) is None
    assert compile_cache.resolve_cache_dir(tmp_path / "here") == tmp_path / "here"
    monkeypatch.setenv(compile_cache.CACHE_ENV, "off")
    assert compile_cache.resolve_cache_dir(None) is None
    assert compile_cache.resolve_cache_dir(tmp_path) == tmp_path  # the keyword first
    monkeypatch.setenv(compile_cache.CACHE_ENV, str(tmp_path / "env"))
    assert compile_cache.resolve_cache_dir(None) == tmp_path / "env"
    assert compile_cache.resolve_cache_dir(None, host_budget=True) == tmp_path / "env"  # asked for
    with pytest.raises(ValueError, match="compile_cache"):
        compile_cache.resolve_cache_dir(3)  # type: ignore[arg-type]


def test_a_captured_graph_as_bytes_keeps_its_traced_sizes_and_runs_outside_a_model():
    captured: list[tuple[fx.GraphModule, list]] = []

    def keep(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        captured.append((gm, example_inputs))
        return gm

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = (x @ w).view(x.shape[0], -1, 2)  # a view: its traced value has a base
        return y.transpose(1, 2).sum(-1)

    x, w = torch.randn(5, 8), torch.randn(8, 6)
    torch.compile(f, backend=keep, dynamic=True)(x, w)
    gm, example_inputs = captured[0]
    saved = dynamo_package.graph_bytes(gm)
    again = dynamo_package.graph_from_bytes(saved)

    def sizes(graph: fx.GraphModule) -> list[str]:
        values = [n.meta.get("example_value") for n in graph.graph.nodes]
        return [str(v.shape) for v in values if isinstance(v, torch.Tensor)]

    assert sizes(again) == sizes(gm)
    assert any("s" in size for size in sizes(gm))  # symbolic sizes survive
    call = [int(a) if isinstance(a, torch.SymInt) else a for a in example_inputs]
    # no offloaded model runs now: the graph runs as it was captured
    assert torch.equal(compile_cache.LoadedGraph(saved)(*call)[0], f(x, w))


def test_a_graph_saved_before_a_hook_is_not_served_to_a_model_with_the_hook(tiny, example_input, tmp_path):
    """A module given a forward hook is not served a graph saved without it (dynamo does not guard on an
    empty hook dict: the key counts hooks): it is captured anew, and its hook runs."""
    cache = tmp_path / "cache"
    first = tiny("llama")
    ids = example_input(first)
    _offloaded_logits(first, ids, cache)
    assert list(cache.glob("*/entry"))
    hooked = tiny("llama")
    seen: list[torch.Size] = []
    hooked.model.layers[1].mlp.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad():
        expected = hooked(ids).logits
    seen.clear()
    got, _ = _offloaded_logits(hooked, ids, cache)
    assert torch.equal(got, expected)
    assert seen == [expected.shape[:2] + (hooked.config.hidden_size,)]


def test_a_frame_whose_capture_failed_is_saved_to_be_captured_again_not_skipped():
    """A frame left without captured code because its capture raised (a refused budget) is saved
    bypassed: the next process captures it anew. One dynamo skipped itself is saved as a skip."""

    def refuses(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        raise ValueError("refused")

    def computes(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) + 1

    def nothing_to_capture(x: torch.Tensor) -> torch.Tensor:
        return x

    x = torch.randn(3)
    entries = {}
    for fn in (computes, nothing_to_capture):
        package = dynamo_package.new_package(fn)
        compiled = torch._dynamo.optimize(refuses, package=package)(fn)
        with contextlib.suppress(Exception):  # dynamo wraps what the backend raised
            compiled(x)
        (entries[fn.__name__],) = package.saved_entry().codes
    assert not entries["computes"].guarded_codes and entries["computes"].bypassed
    assert not entries["nothing_to_capture"].guarded_codes and not entries["nothing_to_capture"].bypassed


def _resumed(x: torch.Tensor, flag: bool) -> torch.Tensor:
    x = x + 1
    torch._dynamo.graph_break()
    return x * 2 if flag else x * 3  # only the resumed frame reads ``flag``: only its guards hold it


def test_a_frame_resumed_in_code_another_entry_made_is_captured_and_not_saved():
    """Two entries of one function in a process (one model at two budgets): the second's call passes the
    first's guards and resumes in the function the first made, whose guards it misses. Torch's package
    refuses that frame; ours captures it, leaves it out of its entry, and saves it bypassed once its own
    capture makes the same resume function."""

    def keep(gm: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
        return gm

    x = torch.randn(3)
    first, second = dynamo_package.new_package(_resumed), dynamo_package.new_package(_resumed)
    with dynamo_package.saving_guards():
        torch._dynamo.optimize(keep, package=first)(_resumed)(x, True)
        compiled = torch._dynamo.optimize(keep, package=second)(_resumed)
        assert torch.equal(compiled(x, False), _resumed(x, False))
        assert [code.python_code.co_name for code in second.saved_entry().codes] == ["_resumed"]
        compiled(x.double(), False)  # misses the first's guards: captured here, resume function and all
    resumed = [code for code in second.saved_entry().codes if code.python_code.co_name != "_resumed"]
    assert len(resumed) == 1 and resumed[0].bypassed and resumed[0].install_to_global
