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
    chunked = chunked_kl_sum(head.weight, student, teacher, selected, 2.0, chunk)
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
    assert parts.kl_sum > 0  # random SwiftKV weights: the student differs from the teacher
    parts.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def _packed_batch(lengths: list[int], seq_len: int = 48) -> dict[str, torch.Tensor]:
    rows = pack_rows([_example(n, i) for i, n in enumerate(lengths)], max_seq_len=seq_len, pad_id=2)
    return {k: torch.as_tensor(v)[None] for k, v in rows[0].items()}


@pytest.mark.parametrize("hidden_loss_weight", [0.0, 0.5])
@pytest.mark.parametrize("group", [1, 2])
def test_student_from_the_teacher_prefix_gives_the_same_loss_and_gradients(hidden_loss_weight, group):
    """Layers 0..c-1 run once and both models start from the state entering layer c: the loss and
    every SwiftKV gradient equal two full forwards exactly (float32), and the student's layers
    before the cutoff do not run at all."""
    results = []
    for reuse in (False, True):
        model = tiny_swiftkv_model("llama", num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=group)
        trainable = freeze_all_but_swiftkv(model)
        objective = DistillationObjective(model, 2.0, hidden_loss_weight, chunk_tokens=8,
                                          reuse_teacher_prefix=reuse)
        calls: list[int] = []
        hook = model.model.layers[0].register_forward_hook(lambda *_, seen=calls: seen.append(1))
        parts = objective(**_packed_batch([9, 14, 11]), token_scale=1 / 31)
        hook.remove()
        parts.loss.backward()
        results.append((parts.loss.detach(), parts.kl_sum, [p.grad.clone() for p in trainable], len(calls)))
    (loss_a, kl_a, grads_a, calls_a), (loss_b, kl_b, grads_b, calls_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(kl_a, kl_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))
    assert (calls_a, calls_b) == (2, 1)  # layer 0 ran for teacher and student before; once now


def test_token_normalisation_is_a_mean_over_every_selected_token_of_the_step():
    """Two micro-batches of different selected-token counts: with ``token_scale`` = micro-batches /
    tokens of the step, the mean of the two losses (what gradient accumulation averages) is the KL
    summed over both, over all their tokens; the reference normalisation divides each micro-batch's
    KL sum by its own positions, selected or not."""
    model = tiny_swiftkv_model("llama")
    freeze_all_but_swiftkv(model)
    batches = [_packed_batch([9]), _packed_batch([20, 14])]
    tokens = [int(b["loss_mask"].sum()) for b in batches]
    objective = DistillationObjective(model, 2.0, 0.0, chunk_tokens=8)
    with torch.no_grad():
        parts = [objective(**b, token_scale=2 / sum(tokens)) for b in batches]
        step_loss = sum(p.loss for p in parts) / 2
        torch.testing.assert_close(step_loss, 4.0 * sum(p.kl_sum for p in parts) / sum(tokens))
        objective.normalization = "reference"
        ref = objective(**batches[0])
        torch.testing.assert_close(ref.loss, 4.0 * ref.kl_sum / batches[0]["loss_mask"].numel())

