"""Loading the student for distillation: under ZeRO-3 a SwiftKV checkpoint is built already
partitioned (no rank holds the whole model), with exactly the checkpoint's weights."""

from __future__ import annotations

import socket

import deepspeed
import pytest
import torch
from safetensors.torch import load_file

from swiftkv.distill.model_io import load_student
from tests.tiny import tiny_swiftkv_model

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-rank gloo process group, as a Ray Train worker has, torn down afterwards (vLLM tests
    in this process set up their own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_zero3_builds_a_swiftkv_checkpoint_partitioned(one_rank_group, tmp_path):
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")

    model = load_student(str(tmp_path), 2, 1, torch.float32, ZERO3)

    params = dict(model.named_parameters())
    # Every parameter was created under zero.Init: the module holds none of its values itself.
    assert all(hasattr(p, "ds_id") and p.numel() == 0 for p in params.values())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, value in saved.items():
            assert torch.equal(params[name], value), name


def test_without_zero3_the_model_is_whole(tmp_path):
    tiny_swiftkv_model("llama", num_hidden_layers=4, num_key_value_layers=2).save_pretrained(tmp_path)
    model = load_student(str(tmp_path), 2, 1, torch.float32, {**ZERO3, "zero_optimization": {"stage": 2}})
    assert not any(hasattr(p, "ds_id") for p in model.parameters())
    assert all(p.numel() > 0 for p in model.parameters())
