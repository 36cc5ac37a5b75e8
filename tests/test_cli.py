"""The fxoffload-hf command and the examples, run as a person would, on tiny checkpoints.

Commands that run a model (``generate``, ``demo``) and the examples run in a new interpreter; ``plan``
and the refusals call the command's ``main`` in this one (each new interpreter costs about 3 s of
imports here), with its output captured the same way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from fxoffload_hf import cli

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fxoffload_hf.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture
def command(capsys):
    """``command(*args)``: the command's ``main`` in this interpreter, as ``run`` reports it: exit code,
    stdout and stderr (the environment it changes is put back)."""

    def call(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with mock.patch.dict(os.environ):
            code = cli.main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["fxoffload-hf", *args], code, out, err)

    return call


def save_tokenizer(folder: Path) -> None:
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(1000)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token="w1").save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoint(llama_master, tmp_path_factory) -> Path:
    """This module's copy of the tiny Llama checkpoint (tests add a tokenizer to it)."""
    folder = tmp_path_factory.mktemp("cli") / "ckpt"
    shutil.copytree(llama_master[0], folder)
    return folder


def test_plan_prints_a_table_and_json(checkpoint, command):
    done = command("plan", str(checkpoint), "--cpu-memory", "2500000")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pieces" in done.stdout and "smallest budget" in done.stdout
    done = command("plan", str(checkpoint), "--cpu-memory", "2500000", "--json")
    report = json.loads(done.stdout)
    assert len(report["pieces"]) >= 2 and report["smallest_budget"] <= 2_500_000


def test_plan_for_a_gpu_on_a_machine_without_one_shows_the_floor_and_the_tradeoff(checkpoint, command):
    done = command(
        "plan", str(checkpoint), "--device", "cuda", "--gpu-memory", "3MB", "--disk-gbps", "1", "--json"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["device"] == "cuda" and report["budget_name"] == "gpu_memory"
    floor = report["floor_set_by"]
    assert ("streamed alone" in floor or "smallest tiles of rows" in floor) and ".weight" in floor
    speeds = [row["tokens_per_second"] for row in report["tradeoff"]]
    budgets = [row["budget"] for row in report["tradeoff"]]
    assert budgets[0] == report["smallest_budget"] and budgets == sorted(budgets) and len(budgets) >= 3
    assert speeds == sorted(speeds) and speeds[-1] > speeds[0]  # more budget, fewer bytes streamed
    assert report["tradeoff"][-1]["resident"] == report["weight_bytes"]
    table = command("plan", str(checkpoint), "--device", "cuda", "--gpu-memory", "3MB").stdout
    assert "tokens/s" in table and "set by" in table


def test_plan_with_a_budget_too_small_exits_2_and_names_the_smallest(checkpoint, command):
    done = command("plan", str(checkpoint), "--cpu-memory", "100000")
    assert done.returncode == 2
    assert "pass cpu_memory=" in done.stdout


def test_missing_folder_is_an_error_without_traceback(tmp_path):
    done = run("plan", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "error:" in done.stderr


def test_the_command_takes_what_it_imported_out_of_the_collectors_walks(monkeypatch):
    """The installed command (``run``) freezes what is imported before the command and what is left
    before the interpreter's exit (1.3 s of a 70B ``plan``'s 5.7), and exits with ``main``'s code."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="fxoffload-hf")
    assert script.value == "fxoffload_hf.cli:run"
    calls: list[str] = []
    monkeypatch.setattr(cli.gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(cli, "main", lambda: calls.append("main") or cli.EXIT_BAD_INPUT)
    with pytest.raises(SystemExit) as stop:
        cli.run()
    assert stop.value.code == cli.EXIT_BAD_INPUT
    assert calls == ["freeze", "main", "freeze"]


def test_generate_streams_tokens_and_draws_the_timeline(checkpoint, tmp_path):
    save_tokenizer(checkpoint)
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    done = run(
        "generate", str(checkpoint), "--prompt", "w5 w9 w77", "--max-new-tokens", "5", "--cpu-memory", "1500000",
        "--device", "cpu", "--timeline", str(png), "--trace", str(trace),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("w5 w9 w77")
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"].split()[0] for e in events if e["ph"] == "X"}
    assert names == {"copy", "compute"}


def test_generate_runs_several_prompts_as_one_block_each_as_if_alone(checkpoint, llama_master):
    import transformers as tf

    save_tokenizer(checkpoint)
    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    eager = llama_master[1]
    alone = []  # each prompt's text as eager greedy decoding gives it alone
    for prompt in ("w5 w9 w77", "w3 w4"):
        with torch.no_grad():
            out = eager.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=5, do_sample=False)
        alone.append(tokenizer.decode(out[0], skip_special_tokens=True))
    together = run(
        "--quiet", "generate", str(checkpoint), "--prompt", "w5 w9 w77", "--prompt", "w3 w4",
        "--max-new-tokens", "5", "--cpu-memory", "1500000", "--device", "cpu",
    )  # fmt: skip
    assert together.returncode == 0, together.stderr
    assert [len(t.split()) for t in alone] == [3 + 5, 2 + 5]  # each prompt and its five new words
    assert together.stdout.split("\n\n")[:2] == alone


@pytest.mark.usefixtures("llama_layers_break_graphs")  # a decode step in graphs, the second refused
def test_generate_whose_capture_stops_midway_starts_the_answer_again(
    checkpoint, llama_master, command, default_capture, second_graph_refused, monkeypatch
):
    """A streamed generate is not run again by itself where a capture stopped midway (its first tokens
    are printed already): the command says so and starts the answer again, as eager calls."""
    import transformers as tf

    import fxoffload_hf.deferral

    monkeypatch.setattr(fxoffload_hf.deferral, "_CAPTURE_SECONDS_PER_MODULE_CALL", 0.0)  # capture at once
    save_tokenizer(checkpoint)
    tokenizer = tf.AutoTokenizer.from_pretrained(checkpoint)
    with torch.no_grad():
        out = llama_master[1].generate(**tokenizer("w5 w9 w77", return_tensors="pt"), max_new_tokens=5)
    answer = tokenizer.decode(out[0], skip_special_tokens=True)
    done = command(
        "generate", str(checkpoint), "--prompt", "w5 w9 w77", "--max-new-tokens", "5", "--cpu-memory", "1500000",
        "--device", "cpu",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(second_graph_refused) == 2 and "starts again, as eager calls" in done.stderr
    assert done.stdout.rstrip("\n").endswith(answer)


def test_generate_without_tokenizer_says_so(llama_ckpt, command):
    folder, _eager = llama_ckpt
    done = command("generate", str(folder), "--prompt", "hi", "--device", "cpu")
    assert done.returncode == 2 and "no tokenizer" in done.stderr


_SIZE = r"-?\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)"
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _bytes(size: str) -> float:
    """Read back a size the command printed (``'4.83 MiB'``)."""
    value, unit = size.split()
    return float(value) * _UNITS[unit]


def _line(output: str, pattern: str) -> re.Match[str]:
    """The one line of ``output`` that ``pattern`` matches in full."""
    found = [m for line in output.splitlines() if (m := re.fullmatch(pattern, line))]
    assert len(found) == 1, f"{len(found)} lines match {pattern!r} in:\n{output}"
    return found[0]


@pytest.mark.slow
def test_demo_runs_on_a_small_checkpoint(tmp_path):
    done = run(
        "demo", "--size", "0.02", "--max-new-tokens", "3", env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    size = _line(out, rf"Checkpoint: .+ \(({_SIZE}), RANDOM weights: the tokens mean nothing\)").group(1)
    budget = _line(out, rf"CPU budget: ({_SIZE}) \(25% of the model\)").group(1)
    assert _bytes(budget) == pytest.approx(0.25 * _bytes(size), rel=0.01)
    # the plan runs under the demo's budget, in several pieces
    assert _line(out, rf"budget +cpu_memory=({_SIZE})").group(1) == budget
    assert _bytes(_line(out, rf"smallest budget +({_SIZE}) \(captured .+; set by .+\)").group(1)) <= _bytes(
        budget
    )
    assert _bytes(_line(out, rf"eager calls from +({_SIZE}) \(the default, .+; set by .+\)").group(1)) > 0
    assert int(_line(out, r"pieces +(\d+) \(weights per piece .+\)").group(1)) >= 2
    # both runs decoded and were measured
    header = _line(out, r" +eager \(all in RAM\) +fxoffload")
    rate = _line(out, r"decode tokens/s +(\d+\.\d\d) +(\d+\.\d\d)")
    assert float(rate.group(1)) > 0 and float(rate.group(2)) > 0, rate.group(0)
    _line(out, r"prefill seconds +\d+\.\d{3} +\d+\.\d{3}")
    _line(out, rf"peak private memory +{_SIZE} +{_SIZE}")
    _line(out, rf"peak file-backed memory +{_SIZE} +{_SIZE}")
    # the offloaded model gave eager's tokens: True in the fxoffload column of that row
    same = _line(out, r"same tokens as eager +True")
    assert len(same.group(0)) == len(header.group(0)), (same.group(0), header.group(0))
    summary = _line(
        out,
        rf"fxoffload: \d+ weights, .+; pieces per graph \[([\d, ]+)\]; "
        rf"copy hidden behind compute (\d+)%; streamed ({_SIZE})",
    )
    assert max(int(n) for n in summary.group(1).split(", ")) >= 2, summary.group(0)
    assert 0 <= int(summary.group(2)) <= 100, summary.group(0)
    assert _bytes(summary.group(3)) > 0, "nothing was streamed under a 25% budget"


@pytest.mark.parametrize(
    "script",
    [
        ["run_llm.py", "{ckpt}", "--max-new-tokens", "3", "--cpu-memory", "1500000", "--device", "cpu"],
        [
            "pipeline_text_generation.py",
            "{ckpt}",
            "--prompt",
            "w4 w8",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
        ],
        ["plan_only.py", "{ckpt}", "--cpu-memory", "1500000"],
        pytest.param(
            ["plan_only.py", "--llama-70b", "--gpu-memory", "24GiB", "--seq-len", "16"],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["run_llm", "pipeline", "plan_only", "plan_only_70b"],
)
def test_examples_run(checkpoint, script):
    save_tokenizer(checkpoint)
    args = [a.format(ckpt=checkpoint) for a in script]
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
