"""Distillation losses over the selected positions, with full-vocabulary logits made in chunks.

The KL is computed from final hidden states: only ``chunk`` tokens' logits (teacher and student)
exist at any time. Each chunk's gradient with respect to the student's hidden states is taken
right away (a small ``[chunk, hidden]`` tensor) and its logits are dropped, so backward needs no
logits at all. A batch of 8 x 8192 tokens with a 128K vocabulary would otherwise hold 32 GB of
float32 logits per model. The LM head's weight is passed in as a tensor: under ZeRO-3 the caller
has it gathered once for all the chunks, not once per call of the head module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum over rows of KL(softmax(teacher/tau) || softmax(student/tau)), in float32."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="sum")


class _PrecomputedGrad(torch.autograd.Function):
    """``value`` in forward; in backward, ``grad_output * grad`` for ``inputs`` (``grad`` = d value / d inputs)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, inputs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return None, grad_output * grad, None


def chunked_kl_sum(
    head_weight: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    selected: torch.Tensor,
    temperature: float,
    chunk: int,
) -> torch.Tensor:
    """``kl_sum`` of the logits ``student @ head_weight.T`` against the teacher's, over the
    ``selected`` rows of ``[N, H]`` hidden states. Gradients flow to ``student`` only.

    The rows are walked in fixed chunks of ``chunk`` positions and only each chunk's selected rows
    get logits, so the work per chunk depends on ``N`` alone (the same on every rank)."""
    need_grad = torch.is_grad_enabled() and student.requires_grad
    total = student.new_zeros((), dtype=torch.float32)
    grad = torch.zeros_like(student) if need_grad else None
    for start in range(0, student.shape[0], chunk):
        rows = selected[start : start + chunk].nonzero().squeeze(-1) + start
        s = student[rows].detach().requires_grad_(need_grad)
        with torch.no_grad():
            teacher_logits = F.linear(teacher[rows], head_weight)
        kl = kl_sum(F.linear(s, head_weight), teacher_logits, temperature)
        if need_grad and rows.numel():
            grad[rows] = torch.autograd.grad(kl, s)[0]
        total = total + kl.detach()
    if not need_grad:
        return total
    return _PrecomputedGrad.apply(total, student, grad)
