"""The chunked KL and the teacher/student objective."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swiftkv.distill.loss import chunked_kl_sum, kl_sum
from swiftkv.distill.objective import DistillationObjective, freeze_all_but_swiftkv
from swiftkv.distill.packing import pack_rows
from tests.test_distill_data import _example
from tests.tiny import tiny_swiftkv_model


def test_kl_matches_the_definition():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(5, 50, generator=gen), torch.randn(5, 50, generator=gen)
    p = F.softmax(t / 2, -1)
    expected = (p * (p.log() - F.log_softmax(s / 2, -1))).sum()
    torch.testing.assert_close(kl_sum(s, t, 2.0), expected)
    assert kl_sum(t, t, 2.0).abs() < 1e-5


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_kl_equals_whole_batch_kl_and_gradients(chunk):
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False).requires_grad_(False)
    student = torch.randn(23, 16, generator=gen, requires_grad=True)
    teacher = torch.randn(23, 16, generator=gen)
    selected = torch.rand(23, generator=gen) < 0.6
    whole = kl_sum(head(student[selected]), head(teacher[selected]), 2.0)
    (grad_whole,) = torch.autograd.grad(whole, student)
    chunked = chunked_kl_sum(head, student, teacher, selected, 2.0, chunk)
    (grad_chunked,) = torch.autograd.grad(chunked, student)
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(grad_chunked, grad_whole)


@pytest.mark.parametrize("hidden_loss_weight", [0.0, 0.5])
def test_objective_trains_only_swiftkv_weights(hidden_loss_weight):
    model = tiny_swiftkv_model("qwen2")
    trainable = freeze_all_but_swiftkv(model)
    assert {id(p) for p in trainable} == {id(p) for _, p in model.swiftkv_parameters()}
    objective = DistillationObjective(model, temperature=2.0, hidden_loss_weight=hidden_loss_weight, chunk_tokens=8)
    rows = pack_rows([_example(n, i) for i, n in enumerate([9, 14])], max_seq_len=32, pad_id=2)
    batch = {k: torch.as_tensor(v)[None] for k, v in rows[0].items()}
    parts = objective(**batch)
    assert parts.tokens == int(batch["loss_mask"].sum()) == 8 + 13
    assert parts.kl > 0  # random SwiftKV weights: the student differs from the teacher
    parts.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
