"""The SwiftKV attention of a layer after the cutoff (j >= c).

It keeps the family's own attention (teacher path) and adds the student's projections:
``q_proj_swiftkv`` on every such layer, ``k_proj_swiftkv``/``v_proj_swiftkv`` on AcrossKV group
leaders only. In the student path the layer's K/V are not computed here: the model computes
them once from the normed cutoff state (see ``model.py``) and hands them in as ``swiftkv_kv``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward, rotate_half


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of one tensor ``[batch, heads, tokens, head_dim]`` at its tokens' positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def is_group_leader(layer_idx: int, num_key_value_layers: int, key_value_group_size: int) -> bool:
    """A layer after the cutoff whose K/V projections the whole AcrossKV group reads."""
    return layer_idx >= num_key_value_layers and (layer_idx - num_key_value_layers) % key_value_group_size == 0


def _like(linear: nn.Linear) -> nn.Linear:
    return nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)


class SwiftKVAttentionMixin:
    """Mixed in before a family's attention class (``LlamaAttention``, ``Qwen2Attention``, ...)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_proj_swiftkv = _like(self.q_proj)
        if is_group_leader(layer_idx, config.num_key_value_layers, config.key_value_group_size):
            self.k_proj_swiftkv = _like(self.k_proj)
            self.v_proj_swiftkv = _like(self.v_proj)

    def swiftkv_key_value(
        self, normed_cutoff_state: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K (with rotary) and V of this group leader, from ``norm_swiftkv(h)`` of every token."""
        shape = (*normed_cutoff_state.shape[:-1], -1, self.head_dim)
        key = self.k_proj_swiftkv(normed_cutoff_state).view(shape).transpose(1, 2)
        value = self.v_proj_swiftkv(normed_cutoff_state).view(shape).transpose(1, 2)
        return apply_rope(key, *position_embeddings), value

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        swiftkv_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if swiftkv_kv is None:  # teacher: the family's own attention, untouched
            return super().forward(
                hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                past_key_values=past_key_values,
                **kwargs,
            )
        input_shape = hidden_states.shape[:-1]
        query = self.q_proj_swiftkv(hidden_states).view(*input_shape, -1, self.head_dim).transpose(1, 2)
        query = apply_rope(query, *position_embeddings)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(
            self,
            query,
            *swiftkv_kv,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            # Qwen2 keeps a per-layer window, Mistral a model-wide one, Llama none.
            sliding_window=getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)),
            **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
