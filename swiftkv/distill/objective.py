"""One module object in two modes: the teacher (SwiftKV off) and the student (SwiftKV on).

``DistillationObjective`` wraps the causal LM so that DeepSpeed sees one ``forward`` per
micro-batch that returns the loss: the teacher pass (no grad), the student pass and the chunked
KL all run inside it, so ZeRO-3's parameter gathering hooks see an ordinary forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from swiftkv.distill.loss import chunked_kl_sum, hidden_mse


class LossParts(NamedTuple):
    # A tuple, so that ZeRO-3's hooks find the tensors in the module's output.
    loss: torch.Tensor
    """What backward runs on: ``tau^2 * KL + hidden_loss_weight * MSE``."""
    kl: torch.Tensor
    """KL per selected token at temperature tau (without the tau^2 factor)."""
    tokens: int
    """Selected tokens in the micro-batch."""


def freeze_all_but_swiftkv(model: nn.Module) -> list[nn.Parameter]:
    """Only the SwiftKV weights train (SPEC: training anything else costs accuracy); returns them."""
    model.requires_grad_(False)
    trainable = [p for _, p in model.swiftkv_parameters()]
    for p in trainable:
        p.requires_grad_(True)
    frozen_ids = {id(p) for p in trainable}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in frozen_ids]
    assert not stray and trainable, f"trainable parameters must be exactly the SwiftKV ones (stray: {stray})"
    return trainable


class DistillationObjective(nn.Module):
    def __init__(self, model: nn.Module, temperature: float, hidden_loss_weight: float, chunk_tokens: int):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.hidden_loss_weight = hidden_loss_weight
        self.chunk_tokens = chunk_tokens

    def hidden(self, swiftkv: bool, input_ids: torch.Tensor, position_ids: torch.Tensor):
        # No attention mask and no cache: transformers reads the restarting position ids as packed
        # examples and keeps attention inside each one (see packing.py).
        self.model.swiftkv(swiftkv)
        return self.model.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=self.hidden_loss_weight > 0,
        )

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, loss_mask: torch.Tensor) -> LossParts:
        selected = loss_mask.bool()
        with torch.no_grad():
            teacher = self.hidden(False, input_ids, position_ids)
        student = self.hidden(True, input_ids, position_ids)
        tokens = int(selected.sum())
        width = student.last_hidden_state.shape[-1]
        kl = chunked_kl_sum(
            self.model.get_output_embeddings(),
            student.last_hidden_state.reshape(-1, width),
            teacher.last_hidden_state.reshape(-1, width),
            selected.reshape(-1),
            self.temperature,
            self.chunk_tokens,
        ) / max(tokens, 1)
        loss = kl * self.temperature**2
        if self.hidden_loss_weight > 0:
            # The second-to-last hidden state, as in the reference recipe's MSE term.
            mse = hidden_mse(student.hidden_states[-2][selected], teacher.hidden_states[-2][selected])
            loss = loss + self.hidden_loss_weight * mse
        return LossParts(loss=loss, kl=kl.detach(), tokens=tokens)
