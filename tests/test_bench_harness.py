"""The benchmark harness's pure parts: rounds and paired ratios, the table, the notes, the targets."""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import cgroup, disk, measure, model, protocol, report, rounds, targets  # noqa: E402
from harness.children import ChildRun, summarize  # noqa: E402

MiB = 2**20


def run_row(rate: float | None, status: str = "ok", **extra) -> dict:
    return {"status": status, "decode_tok_s": rate, **extra}


# --- rounds ----------------------------------------------------------------------------------------


def test_interleave_runs_every_mode_once_a_round_in_order():
    calls = []
    runs = rounds.interleave(["a", "b"], 3, lambda mode, i: calls.append((mode, i)) or {"i": i})
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert [r["i"] for r in runs["b"]] == [0, 1, 2]


def test_median_run_keeps_the_median_round_and_every_rounds_rate():
    rows = [
        run_row(9.0, wall=1),
        run_row(None, "timeout", wall=2),
        run_row(12.0, wall=3),
        run_row(10.0, wall=4),
    ]
    chosen = rounds.median_run(rows)
    assert chosen["wall"] == 4  # of 9, 10, 12 the median is 10; the failed round is no candidate
    assert chosen["decode_tok_s_rounds"] == [9.0, None, 12.0, 10.0]
    assert "decode_tok_s_rounds" not in rows[3]  # a copy, not the round's own row
    # with an even count the lower of the two middle runs
    assert rounds.median_run([run_row(4.0), run_row(2.0)])["decode_tok_s"] == 2.0


def test_median_run_without_any_rate_is_the_first_run():
    rows = [run_row(None, "failed (rc=1)", wall=1), run_row(None, "timeout", wall=2)]
    assert rounds.median_run(rows) is rows[0]


def test_paired_ratio_is_the_median_of_each_rounds_ratio_not_the_ratio_of_medians():
    # a slow spell in round 2 hits both modes: each round's ratio is 1.0 while the medians differ
    fx = {"decode_tok_s_rounds": [10.0, 5.0, 12.0]}
    eager = {"decode_tok_s_rounds": [10.0, 5.0, 12.0]}
    assert rounds.paired_ratio(fx, eager) == pytest.approx(1.0)
    fx = {"decode_tok_s_rounds": [9.0, 6.0, 12.0]}
    eager = {"decode_tok_s_rounds": [10.0, 5.0, 16.0]}
    assert rounds.paired_ratio(fx, eager) == pytest.approx(0.9)  # ratios 0.9, 1.2, 0.75


def test_paired_ratio_skips_rounds_missing_a_side_and_needs_two_pairs():
    assert rounds.paired_ratios([2.0, None, 3.0, 4.0], [1.0, 1.0, 0.0, 2.0]) == [2.0, 2.0]
    assert (
        rounds.paired_ratio({"decode_tok_s_rounds": [2.0, None]}, {"decode_tok_s_rounds": [1.0, 1.0]}) is None
    )
    assert rounds.paired_ratio({}, {"decode_tok_s_rounds": [1.0, 1.0]}) is None


# --- targets ---------------------------------------------------------------------------------------


def free_runs() -> dict[str, dict]:
    memory = {
        "peak_anon": 300 * MiB,
        "after_import": {"RssAnon": 200 * MiB},
        "measure_start": {"RssAnon": 250 * MiB},
    }
    return {
        "eager": run_row(10.0, decode_tok_s_rounds=[10.0, 8.0, 12.0]),
        "fxoffload": run_row(9.0, decode_tok_s_rounds=[9.6, 8.8, 9.0], memory=memory),
        "accelerate": run_row(4.0, decode_tok_s_rounds=[4.0, 5.0, 4.0]),
    }


def test_offload_targets_judge_paired_rounds_and_memory(capsys):
    out = targets.offload_targets(free_runs(), {}, None, budget=200 * MiB)
    by_name = {t["name"]: t for t in out}
    eager = by_name["decode tok/s fxoffload / eager"]
    assert eager["value"] == pytest.approx(0.96)  # ratios 0.96, 1.1, 0.75; the medians' ratio is 0.9
    assert eager["pass"] is True
    assert "median of the 3 rounds' ratios; ratio of medians 0.900" in eager["note"]
    accel = by_name["decode tok/s fxoffload / accelerate"]
    assert accel["value"] == pytest.approx(2.25) and accel["pass"] is True
    rise = by_name["peak private rise over import / budget (fxoffload)"]
    assert rise["value"] == pytest.approx(0.5) and rise["pass"] is True
    assert by_name["  of which held after warm-up / budget"]["pass"] is None
    assert not any(t["name"].startswith("under limit") for t in out)  # no limited runs, no such targets
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == (
        "  decode tok/s fxoffload / eager                      0.960   target >= 0.9   PASS"
        " (median of the 3 rounds' ratios; ratio of medians 0.900)"
    )
    assert printed[-1] == "    of which held after warm-up / budget              0.250   target (info)   n/a"


def test_offload_targets_fail_a_failed_fxoffload_and_use_a_lower_bound_under_the_limit(capsys):
    free = free_runs()
    free["fxoffload"] = {"status": "failed (rc=1) in load"}
    limited = {
        "eager": run_row(1.0),
        "fxoffload": {"status": "timeout in measure", "decode_tok_s_lower_bound": 0.8},
        "accelerate": run_row(2.0),
    }
    out = targets.offload_targets(free, limited, bound=1.0, budget=100 * MiB)
    by_name = {t["name"]: t for t in out}
    assert by_name["decode tok/s fxoffload / eager"]["pass"] is False
    assert by_name["decode tok/s fxoffload / eager"]["note"] == "(fxoffload: failed (rc=1) in load)"
    assert by_name["under limit: fxoffload / eager"]["value"] == pytest.approx(0.8)
    assert by_name["under limit: fxoffload / eager"]["pass"] is False
    assert by_name["under limit: fxoffload / accelerate"]["value"] == pytest.approx(0.4)
    assert by_name["under limit: fxoffload / disk bound"]["pass"] is False  # 0.8 < 0.9
    assert "lower bound: timeout in measure" in by_name["under limit: fxoffload / disk bound"]["note"]
    assert (
        "peak private rise over import / budget (fxoffload)" not in by_name
    )  # no memory figures from a failed run
    assert "FAIL" in capsys.readouterr().out


def test_a_missing_peer_cannot_be_judged():
    out = targets.offload_targets({"fxoffload": run_row(5.0)}, {}, None, budget=MiB)
    assert [t["pass"] for t in out] == [None, None]
    assert all(t["value"] is None for t in out)


def test_within_judges_a_floor_or_a_ceiling(capsys):
    assert targets.within("step / bound", 1.2, most=1.1)["pass"] is False
    assert targets.within("step / bound", 1.1, most=1.1)["pass"] is True
    floor = targets.within("fx / accelerate", 2.9, least=3)
    assert (floor["target"], floor["pass"]) == (">= 3", False)
    assert capsys.readouterr().out.splitlines()[-1].endswith("target >= 3     FAIL")


def test_rate_of_a_timed_out_run_is_its_lower_bound():
    assert targets.rate(run_row(3.0)) == 3.0
    assert targets.rate({"status": "timeout", "decode_tok_s": 9.0, "decode_tok_s_lower_bound": 1.5}) == 1.5
    assert targets.rate(None) is None


# --- report ----------------------------------------------------------------------------------------


def test_table_lines_keep_the_readmes_format_and_compare_tokens_with_eager():
    memory = {"peak_anon": 292.4 * MiB, "peak_file": 997.6 * MiB}
    rows = [
        ("eager", "none", run_row(12.29, prefill_s=0.3051, memory=memory, tokens=[1, 2])),
        ("fxoffload", "733 MiB", run_row(2.171, prefill_s=0.672, memory=memory, tokens=[1, 3])),
        ("accelerate", "733 MiB", run_row(0.98, prefill_s=1.291, tokens=[1, 2])),
    ]
    assert report.table_lines(rows, eager_tokens=[1, 2]) == [
        "mode        limit    prefill s  decode tok/s  peak private MiB  peak file-backed MiB  tokens = eager",
        "----------  -------  ---------  ------------  ----------------  --------------------  --------------",
        "eager       none     0.305      12.29         292               998                   yes",
        "fxoffload   733 MiB  0.672      2.17          292               998                   NO",
        "accelerate  733 MiB  1.291      0.98          -                 -                     yes",
    ]
    rows[2] = ("accelerate", "733 MiB", {"status": "timeout in measure", "decode_tok_s_lower_bound": 0.5})
    lines = report.table_lines(rows, eager_tokens=None)
    cells = ["accelerate", "733 MiB", "-", ">=0.50 (timeout in measure)", "-", "-", "-"]
    assert re.split(r"\s{2,}", lines[4]) == cells
    assert len({len(line) for line in lines[:2]}) == 1 and lines[2].endswith("-")  # no eager tokens


def test_note_lines_show_rates_by_round_the_bound_and_busy_cpus():
    free = {"eager": run_row(10.0, decode_tok_s_rounds=[10.0, None, 11.5])}
    busy = run_row(2.0, foreign_cpu_share=0.2, engine={"store": "3 weights", "measure_delta": {"calls": 2}})
    rows = [("eager", "none", free["eager"]), ("fxoffload", "733 MiB", busy)]
    failed = {"status": "failed (rc=1) in load", "log_tail": "Traceback\nValueError: too small\n"}
    rows.append(("accelerate", "none", failed))
    lines = report.note_lines({"free": free, "limit": {"limit_bytes": 733 * MiB}}, rows, bound=1.92)
    assert (
        lines[0] == "eager without a limit, decode tok/s by round: 10.00, -, 11.50 (the median run is shown)"
    )
    assert "disk bound  733 MiB  decode tok/s <= 1.92" in lines
    assert any(
        line.startswith("WARNING: fxoffload (limit 733 MiB): other processes used 20%") for line in lines
    )
    assert "fxoffload engine (limit 733 MiB): 3 weights; measured: {'calls': 2}" in lines
    assert "note: accelerate (limit none): failed (rc=1) in load: ValueError: too small" in lines


def test_fmt_and_decode_cell():
    assert report.fmt(None) == "-" and report.fmt(1.234) == "1.23" and report.fmt(1.5, ".0f") == "2"
    assert report.decode_cell({"status": "OOM-killed in load"}) == "OOM-killed in load"


# --- children, protocol, disk, model, cgroup -------------------------------------------------------


def test_summarize_a_timed_out_child_gives_a_lower_bound_from_its_tokens():
    events = [
        {"event": "phase", "phase": "measure", "t": 0.0},
        *({"event": "token", "phase": "measure", "step": i, "t": 10.0 + i} for i in range(3)),
    ]
    row = summarize(ChildRun(-9, True, 30.0, events=events, killed_at=14.0))
    assert row["status"] == "timeout in measure"
    assert row["decode_tok_s_lower_bound"] == pytest.approx(2 / 4)  # 2 steps after the first in 4 s
    assert row["lower_bound_phase"] == "measure" and "log_tail" not in row


def test_summarize_keeps_the_result_of_a_child_that_succeeded(tmp_path):
    log = tmp_path / "child.log"
    log.write_text("noise")
    ok = summarize(ChildRun(0, False, 1.0, events=[{"event": "result", "decode_tok_s": 3.0}], log=log))
    assert ok["status"] == "ok" and ok["decode_tok_s"] == 3.0 and "event" not in ok
    failed = summarize(ChildRun(1, False, 1.0, events=[{"event": "result"}], log=log))
    assert failed["status"] == "failed (rc=1)" and failed["log_tail"] == "noise"


def test_protocol_lines_round_trip_and_the_decode_rate_is_one_over_the_median_step(capsys):
    protocol.emit({"event": "phase", "phase": "load"})
    line = capsys.readouterr().out
    assert protocol.parse(line) == {"event": "phase", "phase": "load"}
    assert protocol.parse("some log line\n") is None
    assert protocol.decode_rate([0.0, 0.1, 0.2, 1.2]) == pytest.approx(10.0)  # steps 0.1, 0.1, 1.0
    assert protocol.decode_rate([5.0]) is None


def test_decode_bound_adds_read_time_to_compute_time():
    assert disk.decode_bound(0.4, 10.0) == pytest.approx(2.0)
    assert disk.decode_bound(0.4, None) is None


def test_llama_config_of_a_size_and_facts_from_safetensors_headers(tmp_path):
    config = model.llama_config(1.0)
    assert config["num_hidden_layers"] == 17  # the README's 1005 MB Llama
    assert model.llama_config(0.01)["num_hidden_layers"] == 1
    for size_gb, dtype, item in ((1.0, "float32", 4), (2.0, "bfloat16", 2), (3.3, "float32", 4)):
        c = model.llama_config(size_gb, dtype=dtype)
        h, i = c["hidden_size"], c["intermediate_size"]
        layer = (4 * h * h + 3 * h * i + 2 * h) * item
        weights = 2 * c["vocab_size"] * h * item + c["num_hidden_layers"] * layer
        assert abs(weights - size_gb * 1e9) <= layer / 2, (size_gb, dtype)
    for name, sizes in (("b.safetensors", [40, 8]), ("a.safetensors", [100])):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i, size in enumerate(sizes):
            header[f"t{i}"] = {"dtype": "U8", "shape": [size], "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header).encode()
        (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    facts = model.checkpoint_facts(tmp_path)
    assert (facts["shards"], facts["tensors"], facts["largest_tensor_bytes"]) == (2, 3, 100)
    assert facts["checkpoint_bytes"] == sum(f.stat().st_size for f in tmp_path.iterdir())
    assert not model.model_is_cached(tmp_path, config)
    (tmp_path / model.META).write_text(json.dumps({"seed": model.SEED, "config": config}))
    assert model.model_is_cached(tmp_path, config)
    assert not model.model_is_cached(tmp_path, model.llama_config(0.5))


def test_cgroup_facts_pick_named_lines():
    text = "cache 4096\nrss 8192\npgmajfault 3\nother 1\n"
    assert cgroup._pick(text, {"rss": "rss", "pgmajfault": "faults"}) == {"rss": 8192, "faults": 3}


def test_peak_sampler_keeps_peaks_overall_and_since_reset():
    from fxoffload_hf.memory import PeakSampler

    with PeakSampler(every=0.005) as sampler:
        start = sampler.sample()["RssAnon"]
        block = bytearray(64 * MiB)
        for page in range(0, len(block), 4096):  # calloc'd pages count only once touched
            block[page] = 1
        sampler.sample()
        del block
        sampler.reset()
    assert sampler.peak_all["RssAnon"] >= start + 60 * MiB
    assert sampler.peak["RssAnon"] < sampler.peak_all["RssAnon"] - 30 * MiB  # the window began after the free


# --- throughput: batches of prompts of different lengths --------------------------------------------


def test_random_prompts_are_seeded_within_their_lengths_and_leave_the_pad_id_out():
    prompts = measure.random_prompts(vocab=50, count=32, shortest=8, longest=64, seed=0)
    assert prompts == measure.random_prompts(50, 32, 8, 64, seed=0)
    assert prompts != measure.random_prompts(50, 32, 8, 64, seed=1)
    assert len(prompts) == 32 and all(8 <= len(p) <= 64 for p in prompts)
    assert len({len(p) for p in prompts}) > 1
    assert all(1 <= token < 50 for p in prompts for token in p)


def test_left_padded_batch_pads_and_masks_on_the_left():
    gen = measure.left_padded([[5, 6, 7], [9]], pad=0)
    assert gen["input_ids"].tolist() == [[5, 6, 7], [0, 0, 9]]
    assert gen["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert (gen["do_sample"], gen["pad_token_id"]) == (False, 0)


class _CountingLM:
    """generate() appends ``step + 1`` to every row for each new token, calling the logits processors."""

    def generate(self, input_ids, max_new_tokens, logits_processor, **_):
        import torch

        out = input_ids
        for step in range(max_new_tokens):
            for processor in logits_processor:
                processor(out, None)
            out = torch.cat([out, torch.full((out.shape[0], 1), step + 1)], dim=1)
        return out


def test_throughput_counts_every_sequences_new_tokens_in_order(capsys):
    batches = [measure.left_padded([[5, 6], [7]]), measure.left_padded([[8, 8, 8]])]
    out = measure.throughput(_CountingLM(), batches, new_tokens=3, clock_phase="measure")
    assert out["tokens"] == [[1, 2, 3]] * 3  # the prompt (and its padding) cut off, batches in order
    assert out["tok_s"] == pytest.approx(9 / out["generate_s"])
    records = [protocol.parse(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in records if r["event"] == "token"] == [1, 2, 3, 1, 2, 3]


def test_kv_cache_bytes_of_a_batch():
    config = model.llama_config(0.5)  # 7 layers of 16 heads of 64, fp32
    assert model.kv_cache_bytes(config, batch=32, positions=80) == 2 * 7 * 1024 * 4 * 32 * 80
    assert model.kv_cache_bytes({**config, "num_key_value_heads": 4}, 1, 1) == 2 * 7 * 256 * 4


def test_sequences_equal_counts_matching_sequences():
    assert report.sequences_equal([[1, 2], [3]], [[1, 2], [3]]) == "yes (2/2)"
    assert report.sequences_equal([[1, 2], [4]], [[1, 2], [3]]) == "NO (1/2)"
    assert report.sequences_equal([[1, 2]], [[1, 2], [3]]) == "NO (1/2)"
    assert report.sequences_equal(None, [[1]]) == "-"


def test_targets_on_another_rate_key_pair_its_rounds(capsys):
    batch = run_row(None, tok_s=30.0, tok_s_rounds=[30.0, 20.0, 33.0])
    one = run_row(None, tok_s=2.0, tok_s_rounds=[2.0, 1.0, 2.0])
    assert targets.rate(batch, "tok_s") == 30.0
    line = targets.at_least("tok/s batch / one", batch, one, targets.rate(one, "tok_s"), 16, "tok_s")
    assert line["value"] == pytest.approx(16.5)  # ratios 15, 20, 16.5; the medians' ratio is 15
    assert line["pass"] is True and "ratio of medians 15.000" in line["note"]
    assert targets.rate({"status": "timeout", "tok_s_lower_bound": 1.5}, "tok_s") == 1.5


def test_gpu_bench_finds_where_offloaded_logits_part_from_eager():
    import torch
    from bench_gpu_offload import compare_logits

    expected = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    assert compare_logits(expected, expected.clone(), prompt_len=4)["first_token_that_differs"] is None
    got = expected.clone()
    got[6, expected[6].argmax()] -= 100  # the greedy token at position 6: the 4th generated (prompt 4)
    found = compare_logits(expected, got, prompt_len=4)
    top2 = expected[6].topk(2).values
    assert found["first_token_that_differs"] == 3 and not found["bit_exact"]
    assert found["eager_top2_margin_there"] == pytest.approx(float(top2[0] - top2[1]))


def test_offload_targets_judge_each_fxoffload_mode_that_ran(capsys):
    """The default mode ("fxoffload-deferred") run alone, or beside the captured one, gets its own rows."""
    free = free_runs()
    free["fxoffload-deferred"] = free.pop("fxoffload")
    names = [t["name"] for t in targets.offload_targets(free, {}, None, budget=200 * MiB)]
    assert "decode tok/s fxoffload-deferred / eager" in names
    assert not any(" fxoffload / " in name for name in names)
    free["fxoffload"] = run_row(9.0, decode_tok_s_rounds=[9.0, 9.0, 9.0])
    names = [t["name"] for t in targets.offload_targets(free, {}, None, budget=200 * MiB)]
    assert {"decode tok/s fxoffload / eager", "decode tok/s fxoffload-deferred / eager"} <= set(names)
    capsys.readouterr()


def test_long_generation_table_says_where_the_cache_went_and_compares_tokens():
    from bench_long_generation import table

    ok = {
        "status": "ok",
        "tok_s": 6.5,
        "memory": {"peak_anon": 300 * MiB},
        "cgroup": {"max_usage": 450 * MiB},
    }
    out = {
        "runs": {
            "fxoffload": {**ok, "tokens": [1, 2, 3], "kv_cache_on_disk": True},
            "accelerate": {"status": "OOM-killed in measure", "cgroup": {"max_usage": 458 * MiB}},
            "eager": {**ok, "tokens": [1, 2, 3], "kv_cache_on_disk": False},
        }
    }
    lines = table(out, limit=458 * MiB)
    fx, acc, eager = (line.split() for line in lines[2:])
    assert fx[:5] == ["fxoffload", "458", "MiB", "6.50", "on"] and fx[-1] == "yes"
    assert "OOM-killed" in acc and acc[-1] == "-"  # no tokens to compare
    assert eager[1] == "none" and eager[-1] == "(itself)"
    out["runs"]["fxoffload"]["tokens"] = [1, 2, 4]
    assert table(out, limit=None)[2].split()[-1] == "NO"


def test_long_generation_rises_are_over_the_loaded_model_against_the_budget():
    from bench_long_generation import rises

    memory = {"after_load": {"RssAnon": 250 * MiB}, "peak_anon": 265 * MiB}
    out = {"runs": {"fxoffload": {"memory": memory}, "accelerate": {"status": "OOM-killed"}}}
    assert rises(out, budget=30 * MiB) == [
        "private memory rise over the loaded model: fxoffload 15 MiB (0.50 of the budget)"
    ]


# --- shrink ----------------------------------------------------------------------------------------


def test_shrink_keeps_the_architecture_at_tiny_or_a_users_widths():
    import transformers
    from harness import shrink

    original = transformers.LlamaConfig()
    tiny = shrink.shrink_config(original)
    assert (tiny.hidden_size, tiny.num_attention_heads, tiny.vocab_size) == (128, 4, 1000)
    wide = shrink.shrink_config(original, shrink.TINY.with_sizes(hidden=512, vocab=32000))
    assert (wide.hidden_size, wide.num_attention_heads, wide.vocab_size) == (512, 8, 32000)
    # widths keep their ratio to the hidden size; depth stays tiny
    ratio = original.intermediate_size / original.hidden_size
    assert abs(wide.intermediate_size / 512 - ratio) < 0.05 and wide.num_hidden_layers == shrink.LAYERS
    # Mamba-2's heads follow the hidden size (heads x head size = expand x hidden)
    mamba2 = shrink.shrink_config(transformers.Mamba2Config(), shrink.TINY.with_sizes(hidden=512))
    assert mamba2.num_heads * mamba2.head_dim == mamba2.expand * 512


def test_a_sweeps_shape_reaches_its_children_through_the_environment(monkeypatch):
    import dataclasses

    from harness import shrink

    monkeypatch.delenv(shrink.SHAPE_VARIABLE, raising=False)
    assert shrink.shape_from_environment() == shrink.TINY
    shape = shrink.TINY.with_sizes(hidden=1024, vocab=32000)
    monkeypatch.setenv(shrink.SHAPE_VARIABLE, json.dumps(dataclasses.asdict(shape)))
    assert shrink.shape_from_environment() == shape and shape.head_dim == 64


def test_a_sweeps_dtype_reaches_its_children_through_the_environment(monkeypatch):
    import torch
    from harness import shrink

    monkeypatch.delenv(shrink.DTYPE_VARIABLE, raising=False)
    assert shrink.dtype_from_environment() is torch.float32
    monkeypatch.setenv(shrink.DTYPE_VARIABLE, "bfloat16")
    assert shrink.dtype_from_environment() is torch.bfloat16
