"""Held-out agreement between student and teacher: KL at temperature 1 and top-1 agreement.

Both are measured on the positions ``loss_on`` selects, summed across Ray Train workers, so every
worker returns the same numbers. The teacher is the same model with SwiftKV off.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from swiftkv.distill.loss import kl_sum
from swiftkv.distill.objective import DistillationObjective


@torch.no_grad()
def heldout_metrics(objective: DistillationObjective, batches: Iterable[dict[str, torch.Tensor]]) -> dict[str, float]:
    """``{"heldout_kl", "heldout_top1", "heldout_tokens"}``: mean KL(teacher || student) per token at
    tau = 1, and the share of positions where the two models' most likely next token is the same."""
    head = objective.model.get_output_embeddings()
    device = head.weight.device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # kl, agreeing, tokens
    for batch in batches:
        selected = batch["loss_mask"].bool().reshape(-1)
        ids, pos = batch["input_ids"], batch["position_ids"]
        teacher = objective.hidden(False, ids, pos).last_hidden_state.flatten(0, 1)
        student = objective.hidden(True, ids, pos).last_hidden_state.flatten(0, 1)
        # Fixed chunks of positions, as in the loss: the same head calls on every rank (ZeRO-3).
        for start in range(0, teacher.shape[0], objective.chunk_tokens):
            rows = selected[start : start + objective.chunk_tokens].nonzero().squeeze(-1) + start
            t_logits, s_logits = head(teacher[rows]), head(student[rows])
            totals[0] += kl_sum(s_logits, t_logits, 1.0).double()
            totals[1] += (s_logits.argmax(-1) == t_logits.argmax(-1)).sum()
        totals[2] += selected.sum()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    kl, agree, tokens = totals.tolist()
    return {"heldout_kl": kl / max(tokens, 1), "heldout_top1": agree / max(tokens, 1), "heldout_tokens": int(tokens)}
