"""One module object in two modes: the teacher (SwiftKV off) and the student (SwiftKV on).

``DistillationObjective`` wraps the causal LM so that DeepSpeed sees one ``forward`` per
micro-batch that returns the loss: the teacher pass (no grad), the student pass and the chunked
KL all run inside it, so ZeRO-3's parameter gathering hooks see an ordinary forward.

Layers ``0..c-1`` are frozen and see the same input in both modes, so by default they run once
(``reuse_teacher_prefix``): the teacher and the student each run layers ``c..L-1`` from the state
entering layer ``c``, detached. The loss and its gradients are those of two full forwards (same
values, float32 bit for bit) without the student's forward through the frozen layers (half of it at
50% SwiftKV). The memory autograd keeps for backward is the same either way: nothing before the
cutoff requires grad, so those layers never kept activations for it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from swiftkv.distill.loss import chunked_kl_sum

Normalization = Literal["tokens", "reference"]


class LossParts(NamedTuple):
    # A tuple, so that ZeRO-3's hooks find the tensors in the module's output.
    loss: torch.Tensor
    """What backward runs on (see ``DistillationObjective.forward``)."""
    kl_sum: torch.Tensor
    """KL at temperature tau summed over the selected tokens (without the tau^2 factor), detached."""
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
    def __init__(
        self,
        model: nn.Module,
        temperature: float,
        hidden_loss_weight: float,
        chunk_tokens: int,
        normalization: Normalization = "tokens",
        reuse_teacher_prefix: bool = True,
    ):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.hidden_loss_weight = hidden_loss_weight
        self.chunk_tokens = chunk_tokens
        self.normalization = normalization
        self.reuse_teacher_prefix = reuse_teacher_prefix

    def gather_head_per_forward(self) -> None:
        """Under ZeRO-3 (call after ``deepspeed.initialize``), have DeepSpeed gather the LM head's
        weight when this module's forward starts and keep it for the whole forward: the KL uses it
        directly for every chunk (DeepSpeed's public ``register_external_parameter``)."""
        weight = self.model.get_output_embeddings().weight
        if hasattr(weight, "ds_id"):
            import deepspeed

            deepspeed.zero.register_external_parameter(self, weight)

    def _decoder(self, swiftkv: bool, layers: str, **inputs):
        self.model.swiftkv(swiftkv)
        return self.model.get_decoder()(
            **inputs, swiftkv_layers=layers, use_cache=False, output_hidden_states=self.hidden_loss_weight > 0
        )

    def teacher_and_student(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
        """Both models' decoder outputs (``last_hidden_state``, and ``hidden_states`` when the hidden
        loss is on); only the student's carries gradients. No attention mask and no cache:
        transformers reads the restarting position ids as packed examples (see packing.py)."""
        if not self.reuse_teacher_prefix:
            with torch.no_grad():
                teacher = self._decoder(False, "all", input_ids=input_ids, position_ids=position_ids)
            return teacher, self._decoder(True, "all", input_ids=input_ids, position_ids=position_ids)
        with torch.no_grad():
            prefix = self._decoder(False, "to_cutoff", input_ids=input_ids, position_ids=position_ids)
            state = prefix.last_hidden_state
            teacher = self._decoder(False, "from_cutoff", inputs_embeds=state, position_ids=position_ids)
        return teacher, self._decoder(True, "from_cutoff", inputs_embeds=state, position_ids=position_ids)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, loss_mask: torch.Tensor, token_scale: float = 1.0
    ) -> LossParts:
        """``normalization="tokens"``: ``loss = tau^2 * token_scale * (KL summed over the selected
        tokens) [+ weight * token_scale * squared hidden error summed over them / hidden size]``; the
        caller sets ``token_scale = workers * micro-batches per step / selected tokens of the whole
        step``, so that after DeepSpeed's averaging over micro-batches and workers the gradient is
        that of the mean over every selected token of the optimizer step.
        ``normalization="reference"`` (the reference implementation's): the KL summed over the
        selected tokens divided by all positions of the micro-batch, the MSE averaged over all of
        them; ``token_scale`` is ignored."""
        selected = loss_mask.bool()
        teacher, student = self.teacher_and_student(input_ids, position_ids)
        width = student.last_hidden_state.shape[-1]
        kl_sum = chunked_kl_sum(
            self.model.get_output_embeddings().weight,
            student.last_hidden_state.reshape(-1, width),
            teacher.last_hidden_state.reshape(-1, width),
            selected.reshape(-1),
            self.temperature,
            self.chunk_tokens,
        )
        scale = token_scale if self.normalization == "tokens" else 1.0 / selected.numel()
        loss = kl_sum * self.temperature**2 * scale
        if self.hidden_loss_weight > 0:
            # The second-to-last hidden state, as in the reference recipe's MSE term.
            s, t = student.hidden_states[-2].float(), teacher.hidden_states[-2].float()
            if self.normalization == "tokens":
                mse = (s[selected] - t[selected]).pow(2).sum() / width * token_scale
            else:
                mse = F.mse_loss(s, t)
            loss = loss + self.hidden_loss_weight * mse
        return LossParts(loss=loss, kl_sum=kl_sum.detach(), tokens=int(selected.sum()))
