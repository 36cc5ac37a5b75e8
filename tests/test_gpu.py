"""GPU path: equivalence, budgets kept, and no host-blocking synchronization in the steady state.

Run on a machine with CUDA by `scripts/gpu_check.sh` (`pytest -m gpu`); skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import traceback
import warnings
from collections.abc import Iterator

import pytest
import torch

import fxoffload_hf
from fxoffload_hf.weight_record import Tier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mlp"])
def test_gpu_offload_equals_eager_on_the_gpu(kind, build_model, example_input, weight_bytes):
    model = build_model(kind)
    x = example_input(kind).cuda()
    with torch.no_grad():
        expected = model.cuda()(x)
        expected = expected if isinstance(expected, torch.Tensor) else expected.logits
    model.cpu()
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cuda")
    try:
        with torch.no_grad():
            out = model(x)
            out = out if isinstance(out, torch.Tensor) else out.logits
            out2 = model(x)
            out2 = out2 if isinstance(out2, torch.Tensor) else out2.logits
        assert fxoffload_hf.engine_of(model).runners[0].program.pieces >= 4
        torch.testing.assert_close(out, expected)
        assert torch.equal(out, out2)
    finally:
        fxoffload_hf.restore(model)


def test_deferred_calls_on_the_gpu_equal_eager_then_capture(
    build_model, example_input, weight_bytes, monkeypatch
):
    # eager calls lend each module its weights copied to the GPU (no mapped pages there)
    import fxoffload_hf.deferral

    model = build_model("llama")
    x = example_input("llama").cuda()
    with torch.no_grad():
        expected = model.cuda()(x).logits
    model.cpu()
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cuda", capture="deferred")
    try:
        engine = fxoffload_hf.engine_of(model)
        with torch.no_grad():
            torch.testing.assert_close(model(x).logits, expected)
            assert engine.runners == [] and engine.stats.eager_calls == 1
            monkeypatch.setattr(fxoffload_hf.deferral, "_CAPTURE_SECONDS_PER_MODULE_CALL", 0.0)
            model(x)  # decides to capture from the next call
            torch.testing.assert_close(model(x).logits, expected)
        assert len(engine.runners) == 1
    finally:
        fxoffload_hf.restore(model)


def test_gpu_budget_is_kept(build_model, example_input, weight_bytes):
    model = build_model("llama", num_hidden_layers=8, hidden_size=512, intermediate_size=1024)
    total = weight_bytes(model)
    budget = int(total * 0.3)
    x = example_input("llama").cuda()
    fxoffload_hf.offload(model, gpu_memory=budget, device="cuda")
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            for _ in range(3):
                model(x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= budget * 1.1, (peak, budget)
    finally:
        fxoffload_hf.restore(model)


@contextlib.contextmanager
def _cuda_syncs() -> Iterator[list[tuple[int, str]]]:
    """Record the CUDA synchronizations made while the block runs, each with the thread that made it.

    Yields a list of ``(thread ident, what)``. Explicit synchronizations are seen by spying on
    ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize`` and ``torch.cuda.Stream.synchronize``;
    implicit ones (``.item()``, a blocking copy to the host, ...) by CUDA sync debug mode "warn", whose
    warnings are raised in the thread that synchronized. (Mode "error" would also raise in the engine's
    read-ahead thread, which waits for its copies by design.)
    """
    syncs: list[tuple[int, str]] = []

    def spy(what: str, original):
        @functools.wraps(original)
        def spied(*args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0]
            where = f"{caller.filename}:{caller.lineno} ({caller.name})"
            syncs.append((threading.get_ident(), f"{what} from {where}"))
            return original(*args, **kwargs)

        return spied

    previous_mode = torch.cuda.get_sync_debug_mode()
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        forward = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" in str(message):
                syncs.append((threading.get_ident(), f"{message} at {filename}:{lineno}"))
            else:
                forward(message, category, filename, lineno, file, line)

        warnings.simplefilter("always")
        warnings.showwarning = show
        patch.setattr(torch.cuda, "synchronize", spy("torch.cuda.synchronize", torch.cuda.synchronize))
        for cls in (torch.cuda.Event, torch.cuda.Stream):
            patch.setattr(cls, "synchronize", spy(f"{cls.__name__}.synchronize", cls.synchronize))
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)


def test_steady_state_has_no_host_blocking_sync(build_model, example_input, weight_bytes):
    caller = threading.get_ident()
    # the check sees this thread's explicit and implicit synchronizations
    with _cuda_syncs() as explicit:
        torch.cuda.synchronize()
    assert any(t == caller and w.startswith("torch.cuda.synchronize") for t, w in explicit), explicit
    with _cuda_syncs() as implicit:
        torch.ones(1, device="cuda").item()
    assert any(t == caller and "synchronizing" in w for t, w in implicit), implicit

    model = build_model("llama")
    x = example_input("llama").cuda()
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cuda")
    try:
        engine = fxoffload_hf.engine_of(model)
        with torch.no_grad():
            model(x)  # capture and profile (synchronizes on purpose)
            model(x)
            torch.cuda.synchronize()
            streamed = engine.stats.bytes_streamed
            with _cuda_syncs() as syncs:
                for _ in range(3):
                    model(x)
            torch.cuda.synchronize()
        # the read-ahead thread waits for its own copies (by design); this thread waits only for the
        # compute of loads it released, which bounds the device memory that queued copies take, and for
        # the ids of the embedding lookups that gather their rows on the host (once a call)
        on_caller = [what for thread, what in syncs if thread == caller]
        bounding = [what for what in on_caller if what.endswith("(wait_computed)")]
        gathers = [what for what in on_caller if "row_lookups.py" in what]
        assert len(bounding) <= 3 * sum(r.program.pieces for r in engine.runners)
        assert len(gathers) <= 3 * 2, gathers  # ids to the host, rows back from pageable memory
        assert [what for what in on_caller if what not in bounding + gathers] == [], "\n".join(on_caller)
        assert engine.stats.bytes_streamed > streamed, "the steady-state calls streamed no weights"
    finally:
        fxoffload_hf.restore(model)


def test_host_ram_holds_each_weight_once(build_model, weight_bytes):
    model = build_model("llama", num_hidden_layers=6, hidden_size=512, intermediate_size=1024)
    ptrs_before = {p.data_ptr() for p in model.parameters()}
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.3), device="cuda")
    try:
        store = fxoffload_hf.engine_of(model).store
        host = [r.host for r in store.records.values() if r.host is not None]
        assert host and all(t.is_pinned() for t in host)
        in_place = sum(t.data_ptr() in ptrs_before for t in host)
        assert in_place == len(host), "weights were copied instead of pinned in place"
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.parametrize("cpu_share", [None, 0.5])
def test_a_checkpoint_streams_to_the_gpu_from_pinned_ram_up_to_cpu_memory(
    cpu_share, tmp_path, save_checkpoint, logits, weight_bytes
):
    eager = save_checkpoint("llama", tmp_path / "ckpt")
    total = weight_bytes(eager)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = logits(eager.cuda(), ids.cuda())
    cpu_memory = None if cpu_share is None else int(total * cpu_share)
    model = fxoffload_hf.from_pretrained(
        tmp_path / "ckpt", gpu_memory=total // 3, cpu_memory=cpu_memory, device="cuda"
    )
    try:
        store = fxoffload_hf.engine_of(model).store
        in_ram = [r for r in store.weights() if r.host is not None]
        assert in_ram and all(r.host.is_pinned() for r in in_ram)
        if cpu_memory is None:  # all of it read once
            assert store.bytes_in(Tier.DISK) == 0
        else:  # what cpu_memory holds; the rest staged from its file at each use
            assert 0 < store.ram_bytes() <= cpu_memory and store.bytes_in(Tier.DISK) > 0
        torch.testing.assert_close(logits(model, ids.cuda()), expected)
    finally:
        fxoffload_hf.restore(model)


@pytest.mark.usefixtures("counted_graph_state")
def test_captured_graphs_state_takes_its_room_from_cpu_memory(
    tmp_path, save_checkpoint, logits, weight_bytes
):
    """A captured graph's state lies in host RAM: weights read into RAM under ``cpu_memory`` make room for
    it (``host_room.fit_host``), and the logits stay eager's."""
    eager = save_checkpoint("llama", tmp_path / "ckpt")
    total = weight_bytes(eager)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    expected = logits(eager.cuda(), ids.cuda())
    cpu_memory = total + 8 * 2**20  # the weights and less than one graph's state with its transient
    model = fxoffload_hf.from_pretrained(
        tmp_path / "ckpt", gpu_memory=total // 3, cpu_memory=cpu_memory, device="cuda", capture="first-call"
    )
    try:
        engine = fxoffload_hf.engine_of(model)
        assert engine.store.ram_bytes() == total
        torch.testing.assert_close(logits(model, ids.cuda()), expected)
        assert engine.runners and engine.captures.host_bytes > 0
        assert engine.store.ram_bytes() + engine.captures.host_bytes <= cpu_memory
        assert engine.store.bytes_in(Tier.DISK) > 0
        torch.testing.assert_close(logits(model, ids.cuda()), expected)
    finally:
        fxoffload_hf.restore(model)


def _sdpa_call(record: list[dict], sdpa):
    """``sdpa``, recording what picks its kernel: layouts, alignment, arguments, and the backend chosen."""

    def recorded(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        record.append(
            {
                "layouts": [(tuple(t.shape), t.stride(), t.data_ptr() % 256) for t in (query, key, value)],
                "mask": None if attn_mask is None else (tuple(attn_mask.shape), attn_mask.dtype),
                "is_causal": is_causal,
                "enable_gqa": enable_gqa,
                "backend": int(
                    torch._fused_sdp_choice(
                        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
                    )
                ),
            }
        )
        return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    return recorded


def test_bf16_sdpa_logits_equal_eager_on_the_gpu(tmp_path):
    """A bf16 Llama with SDPA attention: the offloaded forward's logits equal eager's bit for bit (greedy
    tokens of a 4 GB one parted from eager's on an H200). On failure, the SDPA calls of both, side by side."""
    import transformers

    from fxoffload_hf.align import align_shards_in_place

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=16, num_key_value_heads=16, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    align_shards_in_place(tmp_path / "ckpt")
    # eager as loaded from the checkpoint (the model in memory differs: its rotary frequencies are bf16)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").cuda().eval()
    ids = torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(1)).cuda()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    eager_calls: list[dict] = []
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", _sdpa_call(eager_calls, sdpa))
        expected = eager(ids, attention_mask=torch.ones_like(ids)).logits
    total = sum(p.numel() * p.element_size() for p in eager.parameters())
    del eager
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", gpu_memory=total // 2, device="cuda")
    try:
        with torch.no_grad():
            model(ids, attention_mask=torch.ones_like(ids))
            offloaded_calls: list[dict] = []
            for runner in fxoffload_hf.engine_of(model).runners:
                for step in runner.program.steps:
                    if isinstance(step.fn, torch.fx.GraphModule):
                        for node in step.fn.graph.nodes:
                            if node.target is sdpa:
                                node.target = _sdpa_call(offloaded_calls, sdpa)
                        step.fn.recompile()
            got = model(ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        fxoffload_hf.restore(model)
    differ = (got.float() - expected.float()).abs().max().item()
    sides = "\n".join(f"eager {e}\nfx    {o}" for e, o in zip(eager_calls, offloaded_calls, strict=False))
    assert torch.equal(got, expected), f"max difference {differ}; SDPA calls:\n{sides}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_vocabulary_runs_far_below_its_tables_on_the_gpu(tmp_path, dtype, checkpoint_config):
    """Vocabulary 32,000 against hidden 256 at 15% of the weights on the GPU, below one table: the token
    table stays in host RAM (its rows gathered there), the output head streams in tiles; greedy tokens
    equal eager's, logits within rounding (a tile's product may take another cuBLAS kernel), and device
    memory within the budget."""
    import transformers

    config = checkpoint_config("llama-vocab-heavy")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(tmp_path / "ckpt")
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").cuda().eval()
    ids = torch.randint(1, 32000, (2, 12), generator=torch.Generator().manual_seed(1)).cuda()
    greedy = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
        expected_logits = eager(ids).logits
    total = sum(p.numel() * p.element_size() for p in eager.parameters())
    table = 32000 * 256 * dtype.itemsize
    del eager
    budget = int(total * 0.15)
    assert budget < table
    model = fxoffload_hf.from_pretrained(tmp_path / "ckpt", gpu_memory=budget, device="cuda")
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            got = model.generate(ids, **greedy)
            logits = model(ids).logits
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        store = fxoffload_hf.engine_of(model).store
        assert store.records["model.embed_tokens.weight"].tier is not Tier.DEVICE
        assert any(r.tile_of == "lm_head.weight" for r in store.records.values())
        differ = (logits.float() - expected_logits.float()).abs().max().item()
        print(f"{dtype}: logits max difference {differ} (bit exact: {torch.equal(logits, expected_logits)})")
        assert torch.equal(got, expected), differ
        torch.testing.assert_close(logits, expected_logits)
        assert peak <= budget * 1.1, (peak, budget)
    finally:
        fxoffload_hf.restore(model)


def _vocab_heavy_checkpoint_and_eager_tokens(tmp_path, checkpoint_config):
    """Save the vocabulary-heavy Llama to ``tmp_path / "ckpt"``; a prompt on the GPU, greedy settings,
    eager's tokens for them on the GPU, and the weights' bytes."""
    import transformers

    config = checkpoint_config("llama-vocab-heavy")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").cuda().eval()
    ids = torch.randint(1, 32000, (1, 12), generator=torch.Generator().manual_seed(1)).cuda()
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        expected = eager.generate(ids, **greedy)
    return ids, greedy, expected, sum(p.numel() * p.element_size() for p in eager.parameters())


def test_deferred_calls_gather_embedding_rows_on_the_host(tmp_path, checkpoint_config):
    """Deferred capture on the GPU with a table of 32,000 rows: eager calls lend the token table where it
    lies (pinned host RAM) and gather its rows there, as captured lookups do; tokens equal eager's and the
    table never reaches the device."""
    ids, greedy, expected, total = _vocab_heavy_checkpoint_and_eager_tokens(tmp_path, checkpoint_config)
    model = fxoffload_hf.from_pretrained(
        tmp_path / "ckpt", gpu_memory=int(total * 0.6), device="cuda", capture="deferred"
    )
    try:
        engine = fxoffload_hf.engine_of(model)
        assert engine.deferring
        with torch.no_grad():
            got = model.generate(ids, **greedy)
        assert engine.stats.eager_calls >= 1 and engine.runners == []
        assert torch.equal(got, expected)
        assert engine.store.records["model.embed_tokens.weight"].tier is not Tier.DEVICE
    finally:
        fxoffload_hf.restore(model)


def test_deferred_calls_compute_a_head_larger_than_the_budget_in_tiles_on_the_gpu(
    tmp_path, checkpoint_config
):
    """Deferred capture on the GPU below the output head (``eager_tiles``): eager calls lend its rows a
    tile at a time, each computed alone as a graph's tile is on CUDA; greedy tokens equal eager's, no
    graph is captured, and device memory stays within the budget."""
    ids, greedy, expected, _total = _vocab_heavy_checkpoint_and_eager_tokens(tmp_path, checkpoint_config)
    budget = 32000 * 256 * 4 // 2  # half the head
    model = fxoffload_hf.from_pretrained(
        tmp_path / "ckpt", gpu_memory=budget, device="cuda", capture="deferred"
    )
    try:
        engine = fxoffload_hf.engine_of(model)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            got = model.generate(ids, **greedy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        assert engine.stats.eager_calls >= 1 and engine.runners == []
        assert any(r.tile_of == "lm_head.weight" for r in engine.store.records.values())
        assert torch.equal(got, expected)
        assert peak <= budget * 1.1, (peak, budget)
    finally:
        fxoffload_hf.restore(model)


def test_a_block_of_generates_on_the_gpu_equals_the_calls_one_by_one(build_model, weight_bytes):
    """Three prompts as one block (``run_as_block``): each graph run loads its pieces once for all of them,
    and each prompt's tokens equal those of the same call made alone through the offloaded model."""
    model = build_model("llama")
    fxoffload_hf.offload(model, gpu_memory=int(weight_bytes(model) * 0.5), device="cuda")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 1000, (1, n), generator=gen).cuda() for n in (5, 11, 7)]
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    try:
        alone = [model.generate(ids, **greedy) for ids in prompts]
        engine = fxoffload_hf.engine_of(model)
        together, groups = engine.run_together(
            [lambda ids=ids: model.generate(ids, **greedy) for ids in prompts]
        )
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a, b)
        assert max(groups) == 3
    finally:
        fxoffload_hf.restore(model)


def test_a_bf16_moe_model_is_captured_on_the_gpu(tmp_path, checkpoint_config, weight_bytes):
    """Traced calls take Transformers' per-expert fallback where eager takes cuBLAS' grouped product
    (``eager_paths``): greedy tokens equal, logits close; whether bit for bit is told as a warning."""
    import transformers

    config = checkpoint_config("mixtral-8-experts")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(tmp_path)
    eager = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval().cuda()
    weights = weight_bytes(eager)
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1)).cuda()
    greedy = {"max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        expected, expected_tokens = eager(ids).logits, eager.generate(ids, **greedy)
    model = fxoffload_hf.from_pretrained(
        tmp_path, gpu_memory=weights // 2, device="cuda", capture="first-call"
    )
    try:
        with torch.no_grad():
            logits = model(ids).logits
            tokens = model.generate(ids, **greedy)
        warnings.warn(
            f"bf16 MoE logits bit for bit on the GPU: {torch.equal(logits, expected)}", stacklevel=1
        )
        torch.testing.assert_close(logits, expected, rtol=0.02, atol=0.02)
        assert torch.equal(tokens, expected_tokens)
    finally:
        fxoffload_hf.restore(model)
