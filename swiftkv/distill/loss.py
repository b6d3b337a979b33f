"""Distillation losses over the selected positions, with full-vocabulary logits made in chunks.

The KL is computed from final hidden states: only ``chunk`` tokens' logits (teacher and student)
exist at any time, and each chunk is checkpointed, so backward recomputes its logits instead of
keeping them. A batch of 8 x 8192 tokens with a 128K vocabulary would otherwise hold 32 GB of
float32 logits per model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def kl_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum over rows of KL(softmax(teacher/tau) || softmax(student/tau)), in float32."""
    log_s = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="sum")


def _chunk_kl(head: nn.Module, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    with torch.no_grad():
        teacher_logits = head(teacher)
    return kl_sum(head(student), teacher_logits, temperature)


def chunked_kl_sum(
    head: nn.Module, student: torch.Tensor, teacher: torch.Tensor, temperature: float, chunk: int
) -> torch.Tensor:
    """``kl_sum`` of ``head(student)`` against ``head(teacher)`` for ``[N, H]`` hidden states,
    ``chunk`` rows at a time. Gradients flow to ``student`` only."""
    total = student.new_zeros((), dtype=torch.float32)
    for start in range(0, student.shape[0], chunk):
        s, t = student[start : start + chunk], teacher[start : start + chunk]
        if torch.is_grad_enabled() and s.requires_grad:
            total = total + checkpoint(_chunk_kl, head, s, t, temperature, use_reentrant=False)
        else:
            total = total + _chunk_kl(head, s, t, temperature)
    return total


def hidden_mse(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the selected positions' hidden states (``[N, H]``)."""
    return F.mse_loss(student.float(), teacher.float())
