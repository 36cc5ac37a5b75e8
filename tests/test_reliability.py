"""Reliability (issue 7): faults, interrupts, concurrency, file integrity, leaks and budget input.

Everything goes through the public API (``offload``, ``restore``, ``from_pretrained``, ``engine_of``);
faults are injected by damaging files, filling the offload folder, or patching one piece (or the
read-ahead) of a captured graph. Tests marked ``xfail(strict=True)`` pin engine bugs found here: each
reason names the bug; remove the mark once it is fixed.
"""

from __future__ import annotations

import gc
import hashlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

import fxoffload_hf
from fxoffload_hf.api import OwnedFolder
from fxoffload_hf.runner import PieceError
from fxoffload_hf.safetensors_io import CheckpointError, read_header
from fxoffload_hf.weights import Tier

IDS = torch.randint(0, 1000, (1, 10), generator=torch.Generator().manual_seed(3))
_PASS_RE = re.compile(r"pass (gpu_memory|cpu_memory)=(\d+)")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


def _streamed_shards(model) -> list[Path]:
    """Files the disk tier reads at every call (weights neither resident nor in RAM)."""
    records = fxoffload_hf.engine_of(model).store.records.values()
    return sorted(
        {r.disk.path for r in records if r.disk is not None and r.host is None and r.resident is None}
    )


def _extra_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def _assert_engine_threads_only(before: set[threading.Thread]) -> None:
    extra = _extra_threads(before)
    assert all(t.name.startswith("fxoffload-read") for t in extra), [t.name for t in extra]
    assert len(extra) <= 1, [t.name for t in extra]


def _assert_not_offloaded(model, params_before: dict[str, tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    assert not hasattr(model, "_fxoffload_state"), "the model was left half-offloaded"
    for name, param in model.named_parameters():
        original, values = params_before[name]
        assert param is original, f"{name} was replaced"
        assert torch.equal(param, values), f"{name} changed"


def _params(model) -> dict[str, tuple[torch.nn.Parameter, torch.Tensor]]:
    return {n: (p, p.detach().clone()) for n, p in model.named_parameters()}


def _named_budget(exc: BaseException) -> int:
    inner = getattr(exc, "inner_exception", None) or exc
    match = _PASS_RE.search(str(inner))
    assert match is not None, f"no budget named in: {inner}"
    return int(match.group(2))


# -- fixtures -------------------------------------------------------------------------------------


# llama_ckpt (conftest.py): a private copy of a sharded tiny Llama checkpoint and its eager model


@pytest.fixture
def mlp(build_model):
    """``mlp(width=256, depth=6)``: a seeded MLP in eval mode."""

    def make(width: int = 256, depth: int = 6) -> torch.nn.Module:
        return build_model("mlp", width=width, depth=depth)

    return make


@pytest.fixture
def mlp_case(mlp):
    """The default MLP, a batch of input and the MLP's output for it (before any offload)."""
    model = mlp()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    return model, x, expected


@pytest.fixture
def small_llama(build_model, example_input):
    """A two-layer tiny Llama, its example input and its logits for it (before any offload)."""
    model = build_model("llama", num_hidden_layers=2)
    x = example_input("llama")
    return model, x, _logits(model, x)


@pytest.fixture
def full_folder(tmp_path):
    """A 100 KiB tmpfs: writing a model's weights there runs out of space."""
    mount = tmp_path / "tiny-fs"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=100k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# -- 2. faults ------------------------------------------------------------------------------------


def _damage(victim: Path, how: str) -> None:
    data = victim.read_bytes()
    if how == "deleted":
        victim.unlink()
    elif how == "truncated":
        victim.write_bytes(data[: len(data) // 2])
    elif how == "rewritten":
        # the same tensors saved again with a longer header: every byte range moves, the size grows
        tensors = load_file(victim)
        save_file(tensors, victim, metadata={"format": "pt", "note": "re-saved " * 100})
    else:
        raise ValueError(how)


@pytest.mark.parametrize(
    "how",
    [
        "deleted",
        "truncated",
        pytest.param("rewritten"),
    ],
)
def test_damaged_shard_is_named_at_the_next_call_and_the_model_recovers(llama_ckpt, how):
    folder, eager = llama_ckpt
    expected = _logits(eager)
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=1_500_000, device="cpu", policy="sequential")
    try:
        assert torch.equal(_logits(model), expected)
        shards = _streamed_shards(model)
        assert len(shards) >= 3
        victim = shards[len(shards) // 2]
        original = victim.read_bytes()
        _damage(victim, how)
        with pytest.raises(Exception) as info:  # noqa: B017 - any type, as long as it names the file
            _logits(model)
        assert victim.name in str(info.value), f"{type(info.value).__name__}: {info.value}"
        if how != "rewritten":
            assert isinstance(info.value, CheckpointError)
        victim.write_bytes(original)
        assert torch.equal(_logits(model), expected)
        assert torch.equal(_logits(model), expected)
    finally:
        fxoffload_hf.restore(model)


def test_no_room_in_offload_folder_leaves_no_files_and_no_half_offloaded_model(
    full_folder, small_llama, weight_bytes
):
    model, x, expected = small_llama
    before = _params(model)
    target = full_folder / "weights"
    with pytest.raises(Exception):  # noqa: B017 - the type is checked in the next test
        fxoffload_hf.offload(
            model, cpu_memory=int(weight_bytes(model) * 0.6), offload_folder=target, device="cpu"
        )
    assert [p for p in full_folder.rglob("*") if not p.is_dir()] == []
    assert shutil.disk_usage(full_folder).used < 16 * 1024
    _assert_not_offloaded(model, before)
    assert torch.equal(_logits(model, x), expected)


def test_no_room_in_offload_folder_is_a_clear_oserror(full_folder, small_llama, weight_bytes):
    model, _x, _expected = small_llama
    with pytest.raises(OSError, match="offload_folder"):
        fxoffload_hf.offload(
            model, cpu_memory=int(weight_bytes(model) * 0.6), offload_folder=full_folder, device="cpu"
        )


def test_interrupted_spill_leaves_no_partial_file_and_no_half_offloaded_model(
    tmp_path, monkeypatch, small_llama, weight_bytes
):
    model, _x, _expected = small_llama
    before = _params(model)

    def half_then_interrupt(tensors, path, *args, **kwargs):
        Path(path).write_bytes(b"\0" * 4096)  # some bytes reached the disk
        raise KeyboardInterrupt

    monkeypatch.setattr("fxoffload_hf.weights.save_file", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        fxoffload_hf.offload(
            model, cpu_memory=int(weight_bytes(model) * 0.6), offload_folder=tmp_path / "w", device="cpu"
        )
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []
    _assert_not_offloaded(model, before)


def _interrupt_main_soon(entered: threading.Event) -> threading.Thread:
    def fire() -> None:
        if entered.wait(10):
            time.sleep(0.05)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    thread = threading.Thread(target=fire, name="test-interrupter", daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("where", ["piece", "reader", "signal-after-piece", "signal-while-waiting"])
def test_keyboard_interrupt_mid_forward_leaves_a_working_model(where, mlp_case, weight_bytes):
    if where.startswith("signal") and signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    before_threads = set(threading.enumerate())
    model, x, expected = mlp_case
    fxoffload_hf.offload(model, cpu_memory=int(weight_bytes(model) * 0.6), device="cpu", policy="sequential")
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        engine = fxoffload_hf.engine_of(model)
        (runner,) = engine.runners
        program = runner.program
        assert program.pieces >= 4
        step = next(s for s in program.steps if s.piece == 2)
        piece_fn, load = step.fn, engine.loader.load
        entered, release = threading.Event(), threading.Event()
        loads = []

        def running(fn):
            """The program with piece 2 running ``fn``."""
            return replace(program, steps=tuple(replace(s, fn=fn) if s is step else s for s in program.steps))

        def raising_piece(*args):
            raise KeyboardInterrupt

        def signal_after_piece(*args):
            result = piece_fn(*args)
            import _thread

            _thread.interrupt_main()  # delivered at the next bytecode, somewhere in the runner
            return result

        def raising_load(spec):
            loads.append(spec)
            if len(loads) == 3:
                raise KeyboardInterrupt
            return load(spec)

        def slow_load(spec):
            loads.append(spec)
            if len(loads) == 2:
                entered.set()
                # SIGINT does not wake the runner blocked in Future.result(): the interrupt lands
                # when this read returns (see the report of issue 7); keep the read short
                release.wait(0.5)
            return load(spec)

        if where == "piece":
            runner.program = running(raising_piece)
        elif where == "signal-after-piece":
            runner.program = running(signal_after_piece)
        elif where == "reader":
            engine.loader.load = raising_load
        else:
            engine.loader.load = slow_load
            _interrupt_main_soon(entered)
        try:
            with pytest.raises(KeyboardInterrupt), torch.no_grad():
                model(x)
        finally:
            runner.program = program
            release.set()
            engine.loader.__dict__.pop("load", None)
        # the engine is not stuck: its lock is free for another thread, and the thread left the engine
        took = []

        def probe_lock() -> None:
            took.append(engine.lock.acquire(timeout=5))
            if took[-1]:
                engine.lock.release()

        probe = threading.Thread(target=probe_lock)
        probe.start()
        probe.join()
        assert took == [True]
        with pytest.warns(UserWarning, match="ran outside a captured graph"):
            assert not model.layers[0](x).isnan().any()  # a direct call gets the weights for the call
        for _ in range(3):
            with torch.no_grad():
                assert torch.equal(model(x), expected)
        _assert_engine_threads_only(before_threads)
    finally:
        fxoffload_hf.restore(model)
    assert not [t for t in _extra_threads(before_threads) if t.name.startswith("fxoffload")]


def test_exception_in_a_piece_names_the_piece_and_chains_the_original(mlp_case, weight_bytes):
    model, x, expected = mlp_case
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu")
    try:
        with torch.no_grad():
            model(x)
        (runner,) = fxoffload_hf.engine_of(model).runners
        program = runner.program
        step = next(s for s in program.steps if s.piece == 1)
        original = ValueError("boom in the middle of a piece")

        def failing(*args):
            raise original

        runner.program = replace(
            program, steps=tuple(replace(s, fn=failing) if s is step else s for s in program.steps)
        )
        try:
            with pytest.raises(PieceError) as info, torch.no_grad():
                model(x)
        finally:
            runner.program = program
        assert info.value.__cause__ is original
        assert "piece 1" in str(info.value) and str(step.node.target) in str(info.value)
        assert "boom in the middle of a piece" in str(info.value)
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    finally:
        fxoffload_hf.restore(model)


def test_many_recompilations_never_give_silent_nan(mlp, weight_bytes):
    model = mlp(128, 3)
    fxoffload_hf.offload(model, gpu_memory=2 * weight_bytes(model), device="cpu")
    eager = mlp(128, 3)
    try:
        for rank in range(1, 12):  # each rank is a new graph; dynamo stops compiling after 8
            x = torch.randn(*([2] * (rank - 1)), 128, generator=torch.Generator().manual_seed(rank))
            with torch.no_grad():
                try:
                    out = model(x)
                except (
                    fxoffload_hf.BudgetTooSmallError
                ) as exc:  # a clear refusal is fine, a wrong number is not
                    assert rank > 8 and "pass gpu_memory=" in str(exc), exc
                    continue
                assert torch.equal(out, eager(x)), f"rank {rank}: wrong output (NaN: {out.isnan().any()})"
    finally:
        fxoffload_hf.restore(model)


# -- 1. budget refusals (deterministic companions of the property tests) --------------------------


@pytest.fixture
def up_front_smallest(small_llama):
    """The budget ``offload`` names when refusing ``small_llama`` with gpu_memory=1 (from shapes alone)."""
    model = small_llama[0]
    with pytest.raises(ValueError) as info:
        fxoffload_hf.offload(model, gpu_memory=1, device="cpu")
    return _named_budget(info.value)


def test_refusal_at_the_first_call_is_a_value_error(small_llama, up_front_smallest):
    model, x, _expected = small_llama
    fxoffload_hf.offload(model, gpu_memory=up_front_smallest, device="cpu")
    try:
        with pytest.raises(ValueError, match=r"pass gpu_memory=\d+"):
            _logits(model, x)
    finally:
        fxoffload_hf.restore(model)


def test_budget_named_at_the_first_call_is_the_smallest_that_works(small_llama, up_front_smallest):
    model, x, expected = small_llama
    up_front = up_front_smallest
    fxoffload_hf.offload(model, gpu_memory=up_front, device="cpu")
    try:
        with pytest.raises(Exception) as info:  # noqa: B017 - its type is test_refusal_at_the_first_call_is_a_value_error's
            _logits(model, x)
    finally:
        fxoffload_hf.restore(model)
    smallest = _named_budget(info.value)
    assert smallest > up_front
    for budget, works in ((smallest, True), (smallest - 1, False)):
        fxoffload_hf.offload(model, gpu_memory=budget, device="cpu")
        try:
            if works:
                assert torch.equal(_logits(model, x), expected)
            else:
                with pytest.raises(Exception, match=f"pass gpu_memory={smallest}"):  # noqa: B017
                    _logits(model, x)
        finally:
            fxoffload_hf.restore(model)


def _held_bytes(engine) -> dict[str, int]:
    """What the engine holds on the CPU under cpu_memory: weights in RAM, arena, activations, fixed."""
    records = engine.store.records.values()
    return {
        "weights": sum(r.nbytes for r in records if r.host is not None or r.resident is not None),
        "in_flight": engine.plan.in_flight_bytes,
        "activations": max(engine.activation_bytes),
        "fixed": engine.memory.fixed_bytes,
    }


def test_arena_shrinks_when_pieces_become_resident(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        vocab_size=448, n_embd=192, n_inner=160, n_layer=3, n_head=6, n_positions=64, bos_token_id=0,
        eos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 448, (2, 12), generator=torch.Generator().manual_seed(1))
    expected = _logits(model, ids)
    budget = 1_347_438  # found by test_properties.py: the arena kept its pre-schedule size (fixed since)
    fxoffload_hf.offload(model, cpu_memory=budget, offload_folder=tmp_path, device="cpu")
    try:
        assert torch.equal(_logits(model, ids), expected)
        engine = fxoffload_hf.engine_of(model)
        assert engine.store.bytes_in(Tier.DISK) > 0
        held = _held_bytes(engine)
        assert sum(held.values()) <= budget, (held, budget)
    finally:
        fxoffload_hf.restore(model)


def test_cpu_memory_counts_activations_when_weights_stay_in_ram(tmp_path, mlp):
    model = mlp(256, 4)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    large = sum(p.numel() * 4 for p in model.parameters() if p.numel() * 4 >= 64 * 1024)
    small = sum(p.numel() * 4 for p in model.parameters()) - large
    activations = 64 * 256 * 4 * 2  # two live (64, 256) fp32 intermediates at the peak
    budget = large + small + activations // 2
    fxoffload_hf.offload(model, cpu_memory=budget, offload_folder=tmp_path, device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        held = _held_bytes(fxoffload_hf.engine_of(model))
        assert held["activations"] >= activations // 2
        assert sum(held.values()) <= budget, (held, budget)
    finally:
        fxoffload_hf.restore(model)


# -- 3. concurrency -------------------------------------------------------------------------------


def test_two_threads_calling_one_model_get_eager_results(llama_ckpt):
    folder, eager = llama_ckpt
    short, long = IDS[:, :6], torch.randint(0, 1000, (2, 14), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        want_short, want_long = eager(short).logits, eager(long).logits
        want_tokens = eager.generate(short, max_new_tokens=4, do_sample=False)
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=1_500_000, device="cpu")
    try:
        # capture every graph first: a compile racing a call is test_a_call_waits_for_a_compile_...
        _logits(model, short), _logits(model, long)
        with torch.no_grad():
            model.generate(short, max_new_tokens=4, do_sample=False)
        graphs = len(fxoffload_hf.engine_of(model).runners)
        start = threading.Barrier(2)
        errors: list[BaseException] = []
        results: dict[str, list[bool]] = {"forward": [], "generate": []}

        def forwards() -> None:
            try:
                start.wait()
                for i in range(8):
                    ids, want = (short, want_short) if i % 2 else (long, want_long)
                    results["forward"].append(torch.equal(_logits(model, ids), want))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        def generates() -> None:
            try:
                start.wait()
                for _ in range(3):
                    with torch.no_grad():
                        tokens = model.generate(short, max_new_tokens=4, do_sample=False)
                    results["generate"].append(torch.equal(tokens, want_tokens))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=forwards), threading.Thread(target=generates)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert not any(t.is_alive() for t in threads), "a thread is stuck"
        assert errors == []
        assert results == {"forward": [True] * 8, "generate": [True] * 3}
        assert len(fxoffload_hf.engine_of(model).runners) == graphs
    finally:
        fxoffload_hf.restore(model)


def test_a_call_waits_for_a_compile_in_another_thread(monkeypatch, mlp_case, weight_bytes):
    from fxoffload_hf.engine import Engine

    model, x, expected = mlp_case
    x3 = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(2))  # another rank: a new graph
    with torch.no_grad():
        expected3 = model(x3)
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cpu")
    try:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        compiling, other_done = threading.Event(), threading.Event()
        backend = Engine.__call__

        def slow_backend(self, gm, example_inputs):
            compiling.set()
            other_done.wait(2)  # long enough for the other call to finish, if it does not wait
            return backend(self, gm, example_inputs)

        monkeypatch.setattr(Engine, "__call__", slow_backend)
        outputs: list[torch.Tensor] = []

        def compile_new_graph() -> None:
            with torch.no_grad():
                outputs.append(model(x3))

        thread = threading.Thread(target=compile_new_graph)
        thread.start()
        assert compiling.wait(30)
        try:
            with torch.no_grad():
                during = model(x)  # a graph already captured, called while the other thread compiles
        finally:
            other_done.set()
            thread.join(60)
        assert torch.equal(outputs[0], expected3)
        assert torch.equal(during, expected), f"NaN: {bool(during.isnan().any())}"
    finally:
        fxoffload_hf.restore(model)


# -- 4. integrity ---------------------------------------------------------------------------------


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_checkpoint_files_are_byte_identical_after_load_runs_and_restore(llama_ckpt, tier):
    folder, eager = llama_ckpt
    before = _digests(folder)
    stats = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}
    budget = {"gpu_memory": 1_500_000} if tier == "host" else {"cpu_memory": 1_500_000}
    model = fxoffload_hf.from_pretrained(folder, device="cpu", **budget)
    try:
        work = [u.path for u in model._fxoffload_state.undo if isinstance(u, OwnedFolder)]
        with torch.no_grad():
            assert torch.equal(model.generate(IDS, max_new_tokens=3, do_sample=False),
                               eager.generate(IDS, max_new_tokens=3, do_sample=False))  # fmt: skip
        assert _digests(folder) == before
    finally:
        fxoffload_hf.restore(model)
    assert _digests(folder) == before
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()} == stats
    assert not [w for w in work if Path(w).exists()], "from_pretrained's work folder outlived restore"


def test_offload_folder_writes_are_atomic_and_removed_by_restore(
    tmp_path, monkeypatch, small_llama, weight_bytes
):
    model, x, expected = small_llama
    before = _params(model)
    folder = tmp_path / "offload"
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def spy(src, dst, *args, **kwargs):
        renames.append((Path(src).name, Path(dst).name))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", spy)
    fxoffload_hf.offload(
        model, cpu_memory=int(weight_bytes(model) * 0.6), offload_folder=folder, device="cpu"
    )
    monkeypatch.setattr(os, "replace", real_replace)
    try:
        files = sorted(folder.iterdir())
        assert files and not [p for p in files if p.name.startswith(".partial-")]
        assert renames and all(src.startswith(".partial-") for src, _dst in renames)
        assert sorted(dst for _src, dst in renames) == [p.name for p in files]
        for path in files:
            assert read_header(path)  # complete, valid safetensors
        assert fxoffload_hf.engine_of(model).store.bytes_in(Tier.DISK) > 0
        assert torch.equal(_logits(model, x), expected)
        assert sorted(folder.iterdir()) == files
    finally:
        fxoffload_hf.restore(model)
    assert list(folder.iterdir()) == []
    for name, (param, values) in before.items():
        assert dict(model.named_parameters())[name] is param and torch.equal(param, values)


# -- 5. leaks -------------------------------------------------------------------------------------

RSS_MARGIN = 4 * 2**20  # measured: +0 to +1 MiB between the two samples (all in the first few calls)
TENSOR_MARGIN = 0  # measured: the same count of live tensors after 500 and after 1,000 calls


def _tensor_count() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


def test_thousand_forwards_do_not_grow_memory_or_tensors(mlp_case, weight_bytes):
    model, x, expected = mlp_case
    fxoffload_hf.offload(model, cpu_memory=int(weight_bytes(model) * 0.6), device="cpu")
    process = psutil.Process()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: two OpenMP threads only add contention on a busy machine
    try:
        samples = []
        with torch.no_grad():
            for _half in range(2):
                for _ in range(500):
                    out = model(x)
                assert torch.equal(out, expected)
                samples.append((process.memory_info().rss, _tensor_count()))
        (rss_first, tensors_first), (rss_last, tensors_last) = samples
        assert fxoffload_hf.engine_of(model).stats.calls == 1000
        assert fxoffload_hf.engine_of(model).stats.bytes_streamed > 0
        assert rss_last - rss_first <= RSS_MARGIN, (rss_first, rss_last)
        assert tensors_last - tensors_first <= TENSOR_MARGIN, (tensors_first, tensors_last)
    finally:
        torch.set_num_threads(threads)
        fxoffload_hf.restore(model)


GRAPH_BOUND = 4  # prefill and decode, for a one-token prompt (dynamo specialises sizes of 1) and any other


def test_two_hundred_generate_calls_keep_a_bounded_number_of_graphs(build_model, weight_bytes):
    model = build_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    eager = build_model("llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128)
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 1.3), device="cpu")
    generator = torch.Generator().manual_seed(0)
    counts = []
    try:
        for call in range(200):
            length = call * 7 % 40 + 1  # every length 1..40, five times, shuffled
            ids = torch.randint(0, 1000, (1, length), generator=generator)
            options = dict(
                attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0
            )
            with torch.no_grad():
                tokens = model.generate(ids, **options)
                if call % 25 == 0 or length == 1:
                    assert torch.equal(tokens, eager.generate(ids, **options)), (call, length)
            counts.append(len(fxoffload_hf.engine_of(model).runners))
    finally:
        fxoffload_hf.restore(model)
    assert max(counts) <= GRAPH_BOUND, counts
    assert counts[-1] == counts[40], "graphs are still being added after every prompt length was seen"


# -- 6. budget input through offload() -------------------------------------------------------------

ACCEPT, REFUSE, EITHER = "accept", "refuse", "either"
BUDGETS = [
    ("1.5GiB", ACCEPT),
    ("80%", ACCEPT),
    ("100%", ACCEPT),
    ("  2 GiB ", ACCEPT),
    ("2gib", ACCEPT),
    ("1000TiB", ACCEPT),
    (None, ACCEPT),
    (1e9, ACCEPT),
    (2.5e5, ACCEPT),
    (10**30, ACCEPT),
    (2**64, ACCEPT),
    ("0.001%", EITHER),
    ("1e9", EITHER),
    ("0", REFUSE),
    ("-1", REFUSE),
    ("abc", REFUSE),
    ("", REFUSE),
    ("0%", REFUSE),
    ("101%", REFUSE),
    ("-5%", REFUSE),
    ("1.5.GiB", REFUSE),
    ("12 PB", REFUSE),
    ("0.4B", REFUSE),
    (0, REFUSE),
    (-1, REFUSE),
    (0.5, REFUSE),
    (1.0, REFUSE),
    (-1.0, REFUSE),
    (float("nan"), REFUSE),
    (float("inf"), REFUSE),
    (float("-inf"), REFUSE),
    (True, REFUSE),
    ([1], REFUSE),
    (b"1GiB", REFUSE),
    pytest.param(
        10**400,
        EITHER,
        id="10**400",
    ),
    pytest.param(
        "9" * 400,
        EITHER,
        id="9*400",
    ),
]


@pytest.mark.parametrize("key", ["gpu_memory", "cpu_memory"])
@pytest.mark.parametrize(("value", "expect"), BUDGETS)
def test_budget_input_is_accepted_and_works_or_refused_clearly(key, value, expect, tmp_path, mlp):
    model = mlp(128, 3)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    before = _params(model)
    try:
        fxoffload_hf.offload(model, device="cpu", offload_folder=tmp_path, **{key: value})
    except ValueError as exc:
        assert expect != ACCEPT, f"{key}={value!r} refused: {exc}"
        message = str(exc)
        assert key in message and len(message) < 400, message
        _assert_not_offloaded(model, before)
        return
    except Exception as exc:
        pytest.fail(f"{key}={repr(value)[:40]}: {type(exc).__name__}, not a ValueError: {exc}")
    try:
        assert expect != REFUSE, f"{key}={value!r} was accepted"
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    finally:
        fxoffload_hf.restore(model)
    _assert_not_offloaded(model, before)
