"""Hugging Face's from_pretrained keywords read with Hugging Face's meaning (pure: no model is built)."""

from __future__ import annotations

import pytest
import torch

from fxoffload_hf.integrations.hf_kwargs import REFUSED, Placement, read_hf_placement

NONE = {"gpu_memory": None, "cpu_memory": None, "device": None, "dtype": None}


def test_max_memory_cpu_only_sets_cpu_memory_and_computes_on_the_cpu():
    placement, rest = read_hf_placement({"max_memory": {"cpu": "3MiB"}, "revision": "main"}, **NONE)
    assert placement == Placement(gpu_memory=None, cpu_memory="3MiB", device="cpu", dtype=None)
    assert rest == {"revision": "main"}


@pytest.mark.parametrize("key", [0, "cuda:0"])
def test_max_memory_gpu_key_sets_gpu_memory_and_the_device(key):
    placement, _ = read_hf_placement({"max_memory": {key: "10GiB", "cpu": 2**30}}, **NONE)
    assert placement == Placement(gpu_memory="10GiB", cpu_memory=2**30, device="cuda:0", dtype=None)


def test_device_map_auto_is_accepted_and_not_passed_on():
    placement, rest = read_hf_placement({"device_map": "auto", "attn_implementation": "eager"}, **NONE)
    assert placement == Placement(None, None, None, None)
    assert rest == {"attn_implementation": "eager"}


def test_torch_dtype_is_the_old_name_of_dtype():
    placement, rest = read_hf_placement({"torch_dtype": torch.bfloat16}, **NONE)
    assert placement.dtype is torch.bfloat16 and rest == {}
    with pytest.raises(ValueError, match="not both"):
        read_hf_placement({"torch_dtype": torch.bfloat16}, **(NONE | {"dtype": torch.float16}))


@pytest.mark.parametrize(
    ("kwargs", "ours", "message"),
    [
        ({"device_map": {"": "cpu"}}, {}, "device_map=.*cannot be combined"),
        ({"device_map": "sequential"}, {}, "device_map='sequential'"),
        ({"max_memory": {0: "1GiB", 1: "1GiB"}}, {}, "names 2 GPUs"),
        ({"max_memory": {"disk": "1GiB"}}, {}, "key 'disk' is not a GPU index"),
        ({"max_memory": {"mps": "1GiB"}}, {}, "key 'mps'"),
        ({"max_memory": "1GiB"}, {}, "expected a dict"),
        ({"max_memory": {}}, {}, "expected a dict"),
        ({"max_memory": {"cpu": "1GiB"}}, {"cpu_memory": "2GiB"}, "not both"),
        ({"max_memory": {0: "1GiB"}}, {"device": "cuda:1"}, "GPU 0 but device='cuda:1'"),
    ],
)
def test_keywords_that_contradict_or_cannot_be_read_are_refused(kwargs, ours, message):
    with pytest.raises(ValueError, match=message):
        read_hf_placement(kwargs, **(NONE | ours))


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_every_keyword_fxoffload_cannot_honour_is_refused_by_name(key):
    with pytest.raises(ValueError, match=f"cannot honour {key}="):
        read_hf_placement({key: object()}, **NONE)
