"""Held-out agreement between student and teacher: KL at temperature 1 and top-1 agreement.

Both are measured on the positions ``loss_on`` selects, summed across Ray Train workers, so every
worker returns the same numbers. The teacher is the same model with SwiftKV off.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from swiftkv.distill.loss import kl_sum
from swiftkv.distill.objective import DistillationObjective


def _gathered(param: torch.nn.Parameter) -> AbstractContextManager:
    """While open, ``param`` holds its full value: a ZeRO-3 parameter is gathered from the ranks
    (DeepSpeed's public ``GatheredParameters``, read-only); any other is left as it is."""
    if not hasattr(param, "ds_id"):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([param], modifier_rank=None)


@torch.no_grad()
def heldout_metrics(objective: DistillationObjective, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``{"heldout_kl", "heldout_top1", "heldout_tokens"}``: mean KL(teacher || student) per token at
    tau = 1, and the share of positions where the two models' most likely next token is the same."""
    head = objective.model.get_output_embeddings().weight
    totals = torch.zeros(3, dtype=torch.float64, device=head.device)  # kl, agreeing, tokens
    for batch in batches:
        selected = batch["loss_mask"].bool().reshape(-1)
        teacher, student = objective.teacher_and_student(batch["input_ids"], batch["position_ids"])
        teacher, student = teacher.last_hidden_state.flatten(0, 1), student.last_hidden_state.flatten(0, 1)
        with _gathered(head):  # once per batch under ZeRO-3
            for start in range(0, teacher.shape[0], objective.chunk_tokens):  # chunks bound the logits' memory
                rows = selected[start : start + objective.chunk_tokens].nonzero().squeeze(-1) + start
                t_logits, s_logits = F.linear(teacher[rows], head), F.linear(student[rows], head)
                totals[0] += kl_sum(s_logits, t_logits, 1.0).double()
                totals[1] += (s_logits.argmax(-1) == t_logits.argmax(-1)).sum()
        totals[2] += selected.sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    kl, agree, tokens = totals.tolist()
    return {"heldout_kl": kl / max(tokens, 1), "heldout_top1": agree / max(tokens, 1), "heldout_tokens": int(tokens)}
