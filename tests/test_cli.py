"""The fxoffload-hf command and the examples, run as a person would, on tiny checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_transformers_integration import save_checkpoint

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fxoffload_hf.cli", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )  # fmt: skip


def save_tokenizer(folder: Path) -> None:
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(1000)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tf.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token="w1").save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt")
    save_checkpoint("llama", folder)
    return folder


def test_plan_prints_a_table_and_json(checkpoint):
    done = run("plan", str(checkpoint), "--cpu-memory", "2500000")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pieces" in done.stdout and "smallest budget" in done.stdout
    done = run("plan", str(checkpoint), "--cpu-memory", "2500000", "--json")
    report = json.loads(done.stdout)
    assert len(report["pieces"]) >= 2 and report["smallest_budget"] <= 2_500_000


def test_plan_with_a_budget_too_small_exits_2_and_names_the_smallest(checkpoint):
    done = run("plan", str(checkpoint), "--cpu-memory", "100000")
    assert done.returncode == 2
    assert "pass cpu_memory=" in done.stdout


def test_missing_folder_is_an_error_without_traceback(tmp_path):
    done = run("plan", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "error:" in done.stderr


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


def test_generate_without_tokenizer_says_so(tmp_path):
    save_checkpoint("llama", tmp_path)
    done = run("generate", str(tmp_path), "--prompt", "hi", "--device", "cpu")
    assert done.returncode == 2 and "no tokenizer" in done.stderr


def test_demo_runs_on_a_small_checkpoint(tmp_path):
    done = run(
        "demo", "--size", "0.02", "--max-new-tokens", "3", env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RANDOM weights" in done.stdout
    assert "same tokens as eager" in done.stdout and "True" in done.stdout.split("same tokens as eager")[1]


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
        ["plan_only.py", "--llama-70b", "--gpu-memory", "24GiB", "--seq-len", "16"],
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
