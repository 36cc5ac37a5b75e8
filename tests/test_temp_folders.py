"""temp_folders: a folder left by a process killed outright is removed when the next is made; folders of
running processes, of other hosts and namespaces, and anything without our marker are left alone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile

import psutil
import pytest
import torch

import fxoffload_hf
from fxoffload_hf import temp_folders

_MAKE_AND_WAIT = (
    "import sys, time; from fxoffload_hf import temp_folders; "
    "print(temp_folders.make('fxoffload-hf-'), flush=True); time.sleep(600)"
)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The temporary directory, for this test only (children started by it see it too)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def test_a_killed_processs_folder_is_removed_when_the_next_is_made(temp_root):
    child = subprocess.Popen([sys.executable, "-c", _MAKE_AND_WAIT], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        left = temp_root / child.stdout.readline().strip()
        (left / "fxoffload-0123.safetensors").write_bytes(b"spilled weights")
        assert not temp_folders.remove_stale()  # its process still runs
    finally:
        child.send_signal(signal.SIGKILL)  # nothing of it runs: its folder stays
        child.wait()
    assert left.is_dir()
    mine = temp_folders.make()
    assert not left.exists() and mine.is_dir()
    assert temp_folders.remove_stale() == [] and mine.is_dir()  # this process runs


def test_only_folders_whose_process_is_surely_gone_are_removed(temp_root):
    def folder(name: str, **owner) -> None:
        (temp_root / name).mkdir()
        marker = {**temp_folders._this_process(), **owner}
        (temp_root / name / ".fxoffload-owner").write_text(json.dumps(marker))

    me = psutil.Process()
    folder("fxoffload-reused", started=me.create_time() - 3600)  # this id, started an hour before: reused
    folder("fxoffload-before-boot", pid=1, boot=psutil.boot_time() - 3600)
    folder("fxoffload-other-host", pid=2**22 + 1, host="elsewhere")
    folder("fxoffload-other-namespace", pid=2**22 + 1, pid_namespace="pid:[1]")
    (temp_root / "fxoffload-unmarked").mkdir()  # another tool's, or one being made
    (temp_root / "fxoffload-file").write_text("not a folder")
    (temp_root / "fxoffload-garbled").mkdir()
    (temp_root / "fxoffload-garbled" / ".fxoffload-owner").write_text("{")
    removed = temp_folders.remove_stale()
    assert sorted(p.name for p in removed) == ["fxoffload-before-boot", "fxoffload-reused"]
    assert sorted(p.name for p in temp_root.iterdir()) == [
        "fxoffload-file",
        "fxoffload-garbled",
        "fxoffload-other-host",
        "fxoffload-other-namespace",
        "fxoffload-unmarked",
    ]
    with pytest.raises(ValueError, match="begins with 'fxoffload-'"):
        temp_folders.make("weights-")


def test_spilled_weights_go_to_a_marked_folder_removed_at_restore(temp_root):
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    fxoffload_hf.offload(model, cpu_memory=256 * 256 * 4, device="cpu")
    try:
        (spilled,) = temp_root.glob("fxoffload-*")
        assert any(spilled.glob("*.safetensors"))
        assert temp_folders._owner(spilled) == temp_folders._this_process()
    finally:
        fxoffload_hf.restore(model)
    assert not spilled.exists()
