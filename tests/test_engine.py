"""The engine counts what each captured graph holds in host memory: in a CPU budget, or on a GPU in cpu_memory."""

from __future__ import annotations

import pytest
import torch

from fxoffload_hf.memory_model import GRAPH_STATE_BYTES_PER_OP, BudgetTooSmallError, graph_state_bytes


@pytest.mark.usefixtures("counted_graph_state")
def test_each_captured_graphs_state_is_counted_and_a_budget_below_it_is_refused_by_name(llama_ckpt):
    import fxoffload_hf

    folder, eager = llama_ckpt
    ids = torch.randint(0, 1000, (2, 7), generator=torch.Generator().manual_seed(0))
    model = fxoffload_hf.from_pretrained(folder, cpu_memory="256MiB", device="cpu")
    engine = fxoffload_hf.engine_of(model)
    assert engine.memory.graph_bytes == 0
    try:
        with torch.no_grad():
            got = model(ids, use_cache=False).logits
        counted = engine.memory.graph_bytes
        held = [h.memory for h in engine.memory_holders]
    finally:
        fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(got, eager(ids, use_cache=False).logits)
    assert counted > 0 and counted % GRAPH_STATE_BYTES_PER_OP == 0
    assert all(m is not None and m.graph_bytes == counted for m in held)  # every check sees it
    # a budget the weights alone would stream in, below the graph's state: the capture is refused, and
    # the call runs as eager code (within its bound); one the bound cannot read (a second positional
    # argument) is refused, naming the graph's state
    tight = fxoffload_hf.from_pretrained(folder, cpu_memory=counted // 2, device="cpu")
    tight_engine = fxoffload_hf.engine_of(tight)
    try:
        with torch.no_grad():
            assert torch.equal(tight(ids, use_cache=False).logits, got)
            assert tight_engine.stats.eager_calls == 1 and tight_engine.deferral.new_graphs_refused
            with pytest.raises(BudgetTooSmallError, match="captured graphs' state") as refused:
                tight(ids, None, use_cache=False)
    finally:
        fxoffload_hf.restore(tight)
    assert refused.value.smallest_budget > counted
    assert tight_engine.memory.graph_bytes == 0  # the refused graphs are not kept, nor counted
    # a generate's KV cache is blamed only where the rest fits without it (here: the graph's state)
    tight_engine._set_memory(tight_engine.memory.with_graph(counted // GRAPH_STATE_BYTES_PER_OP))
    with pytest.raises(BudgetTooSmallError, match="cannot hold the rest even without it"):
        tight_engine.expect_activations(1024, "a KV cache of 1 KiB")
    with pytest.raises(BudgetTooSmallError, match="ask for fewer new tokens"):
        engine.expect_activations(2**30, "a KV cache of 1 GiB")


@pytest.mark.usefixtures("counted_graph_state")
def test_a_generate_keeps_room_for_its_second_capture_and_lets_kept_weights_go_when_it_comes(llama_ckpt):
    import fxoffload_hf

    folder, eager = llama_ckpt
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(1))
    generate = {"max_new_tokens": 4, "do_sample": False}
    probe = fxoffload_hf.from_pretrained(folder, cpu_memory="256MiB", device="cpu")
    probed, ops = fxoffload_hf.engine_of(probe), []
    count_probed = probed._count_graph_state
    probed._count_graph_state = lambda n: (ops.append(n), count_probed(n))
    try:
        with torch.no_grad():
            probe.generate(ids, **generate)
        fixed, (prefill, decode) = probed.memory.fixed_bytes, map(graph_state_bytes, ops)
    finally:
        fxoffload_hf.restore(probe)
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    # room for both graphs' state, the decode graph's capture transient and three quarters of the weights:
    # while the prefill runs, the room its transient will take holds all the weights
    budget = fixed + prefill + 2 * decode + weights * 3 // 4
    model = fxoffload_hf.from_pretrained(folder, cpu_memory=budget, device="cpu")
    engine = fxoffload_hf.engine_of(model)
    store = engine.store

    def kept() -> int:
        return sum(r.nbytes for r in store.weights() if r.resident is not None and store.movable(r))

    counted, finished = [], []
    count, finish = engine._count_graph_state, engine.capture_finished

    def counting(ops: int) -> None:
        before = kept()
        count(ops)
        counted.append((before, kept(), engine.memory))

    def finishing() -> None:
        finish()
        finished.append(engine.memory.capture_reserve)

    engine._count_graph_state, engine.capture_finished = counting, finishing
    try:
        with torch.no_grad():
            got = model.generate(ids, **generate)
        after = engine.memory
    finally:
        fxoffload_hf.restore(model)
    with torch.no_grad():
        assert torch.equal(got, eager.generate(ids, **generate))
    (_, _, first), (before, now, second) = counted
    assert first.capture_reserve == first.graph_bytes  # room for dynamo's transient as it finishes graph 1
    assert finished[0] == first.capture_reserve  # kept through graph 1's calls: generate expects another
    # graph 2's state is counted before it runs: what graph 1's profile kept shrinks to fit beside it
    assert before > now and second.fits(resident=now)
    assert finished[1] == 0 and after.capture_reserve == 0  # no capture expected any more


@pytest.mark.usefixtures("counted_graph_state")
def test_graphs_captured_before_a_generate_do_not_count_against_the_two_it_expects(llama_ckpt):
    import fxoffload_hf

    folder, _eager = llama_ckpt
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(2))
    model = fxoffload_hf.from_pretrained(folder, cpu_memory="256MiB", device="cpu")
    engine = fxoffload_hf.engine_of(model)
    reserves, finish = [], engine.capture_finished

    def finishing() -> None:
        finish()
        reserves.append((len(engine.runners), engine.memory.capture_reserve))

    engine.capture_finished = finishing
    try:
        with torch.no_grad():
            model(ids)  # a plain forward's graph first
            with engine.expecting_graphs(2):  # an outer call expecting two more survives an inner one
                with engine.expecting_graphs(1):
                    pass
                assert engine.captures.graphs_expected == len(engine.runners) + 2
            model.generate(ids, max_new_tokens=3, do_sample=False)
        after = engine.memory.capture_reserve
    finally:
        fxoffload_hf.restore(model)
    assert reserves[0] == (1, 0)  # the forward expected no other graph
    # generate's prefill graph keeps room for its decode graph, which then keeps none
    assert [(n, r > 0) for n, r in reserves[1:]] == [(2, True), (3, False)] and after == 0


@pytest.mark.usefixtures("counted_graph_state")
def test_on_a_gpu_each_graphs_state_is_charged_to_cpu_memory(tmp_path, monkeypatch, place_data_at):
    """On a GPU run a captured graph's state lies in host RAM beside the weights read into it: it (and
    its capture's transient, for a moment) takes room from ``cpu_memory``, the weights read last going
    back to their files; the device's budget does not count it."""
    from safetensors.torch import save_file

    from fxoffload_hf import engine as engine_module
    from fxoffload_hf.config import OffloadConfig
    from fxoffload_hf.engine import Engine
    from fxoffload_hf.host_room import read_into_ram
    from fxoffload_hf.memory_model import MemoryModel
    from fxoffload_hf.safetensors_io import read_header
    from fxoffload_hf.weight_record import Tier
    from fxoffload_hf.weights import WeightStore

    monkeypatch.setattr(engine_module, "make_loader", lambda store, device, ops=None: None)  # no GPU here
    save_file({name: torch.randn(128, 128) for name in "abc"}, tmp_path / "w.safetensors")  # 64 KiB each
    place_data_at(tmp_path, 0)
    cuda = torch.device("cuda")
    store = WeightStore(cuda)
    records = [store.add_disk(name, s) for name, s in read_header(tmp_path / "w.safetensors").items()]
    read_into_ram(store, 2**20)
    cpu_memory = store.ram_bytes() + 16 * 2**10
    engine = Engine(
        OffloadConfig(device=cuda, gpu_memory=2**30, cpu_memory=cpu_memory),
        store,
        MemoryModel.where_it_computes("cuda", 2**30, cpu_memory),
    )
    try:
        ops = 2  # 48 KiB of state: with its transient, two weights' room
        engine._count_graph_state(ops)
        state = graph_state_bytes(ops)
        assert engine.captures.host_bytes == state and engine.memory.graph_bytes == 0
        assert store.ram_bytes() + 2 * state <= cpu_memory
        assert [r.tier for r in records] == [Tier.HOST, Tier.DISK, Tier.DISK]  # the model's last first
    finally:
        store.close()


def test_a_call_whose_activations_grow_is_checked_beside_its_own_graphs_pieces(llama_ckpt):
    """What is in flight beside a call's activations are its own graph's pieces: another graph's larger
    pieces (cut when the budget had more room for weights, before later graphs' state was counted) do
    not refuse it. Checked against them, each refusal named a budget that cut those pieces larger again
    (``dots3_note_text``: six refusals in a row)."""
    from types import SimpleNamespace

    import fxoffload_hf

    folder, _eager = llama_ckpt
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(3))
    model = fxoffload_hf.from_pretrained(folder, cpu_memory="2MiB", device="cpu", capture="first-call")
    engine = fxoffload_hf.engine_of(model)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)  # graph 1
            model(ids[:, :3])  # graph 2: another signature (a cache built)
        assert len(engine.runners) == 2
        own, budget = engine._largest_piece(1), engine.memory.budget
        need = budget - engine.memory.smallest_budget(own, 0)  # all the room its own pieces leave
        assert engine.memory.smallest_budget(own, need) <= budget
        engine.partitions[0] = SimpleNamespace(pieces=[SimpleNamespace(weight_bytes=own + 2**20)])
        engine.activations_grew(1, need)  # fits beside its own pieces: planned for, not refused
        assert engine.activation_bytes[1] >= need
        with pytest.raises(BudgetTooSmallError, match="this call's activations"):
            engine.activations_grew(1, need + 2**16)
    finally:
        fxoffload_hf.restore(model)
