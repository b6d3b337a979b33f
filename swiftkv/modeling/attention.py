"""The SwiftKV attention of a layer after the cutoff (j >= c).

It keeps the family's own attention (teacher path) and adds the student's modules, named like the
family's own with ``_swiftkv`` appended: the query modules on every such layer, the key/value
modules on AcrossKV group leaders only. In the student path the layer's K/V are not computed here:
the model computes them once from the normed cutoff state through the leader's
:meth:`~SwiftKVAttentionMixin.swiftkv_cache_entry` and :meth:`~SwiftKVAttentionMixin.swiftkv_expand`
(see ``model.py``) and hands them in as ``swiftkv_kv``.

A family states which of its modules are which (``query_modules``, ``key_value_modules``); the
initialisation (``swiftkv.convert``) reads the same lists: query modules are copied, key/value
modules take the mean over the AcrossKV group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward, rotate_half

from swiftkv.config import shift_layers


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of one tensor ``[batch, heads, tokens, head_dim]`` at its tokens' positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def is_group_leader(layer_idx: int, num_key_value_layers: int, key_value_group_size: int) -> bool:
    """A layer after the cutoff whose K/V projections the whole AcrossKV group reads."""
    return layer_idx >= num_key_value_layers and (layer_idx - num_key_value_layers) % key_value_group_size == 0


def _like(module: nn.Module) -> nn.Module:
    """A new module of the same kind and shape (a linear layer or an RMSNorm), values to be loaded."""
    if isinstance(module, nn.Linear):
        return nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
    return type(module)(module.weight.shape[0], eps=module.variance_epsilon)


class SwiftKVAttentionMixin:
    """Mixed in before a family's attention class (``LlamaAttention``, ``Qwen2Attention``, ...)."""

    query_modules: tuple[str, ...] = ("q_proj",)
    """The family's modules on the query path; those the layer has get a ``_swiftkv`` copy."""
    key_value_modules: tuple[str, ...] = ("k_proj", "v_proj")
    """The family's modules on the key/value path; group leaders get a ``_swiftkv`` copy."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        names = list(self.query_modules)
        if is_group_leader(layer_idx, config.num_key_value_layers, config.key_value_group_size):
            names += self.key_value_modules
        for name in names:
            if getattr(self, name, None) is not None:  # e.g. DeepSeek has q_proj or the q_a/q_b pair
                setattr(self, f"{name}_swiftkv", _like(getattr(self, name)))
        if layer_idx in shift_layers(config):
            if not all(hasattr(self, f"{kind}_proj") for kind in ("k", "v")):
                raise ValueError(f"key_value_shift_layers: the token shift needs k_proj/v_proj attention; "
                                 f"{type(self).__name__} has other key/value modules")
            # The tokens before enter through their own projection (no bias: the own token's has it).
            for kind in ("k", "v"):
                own = getattr(self, f"{kind}_proj")
                setattr(self, f"{kind}_shift_swiftkv",
                        nn.Linear(config.key_value_shift_tokens * own.in_features, own.out_features, bias=False))

    def _heads(self, kind: str, x: torch.Tensor, shifted: torch.Tensor | None = None) -> torch.Tensor:
        """``{kind}_proj_swiftkv(x)`` (plus ``{kind}_shift_swiftkv(shifted)`` on a token-shift layer) as
        ``[batch, heads, tokens, head_dim]``, through the per-head ``{kind}_norm_swiftkv`` where the
        family has one (Qwen3's q/k norms)."""
        out = getattr(self, f"{kind}_proj_swiftkv")(x)
        if shifted is not None:
            out = out + getattr(self, f"{kind}_shift_swiftkv")(shifted)
        out = out.view(*x.shape[:-1], -1, self.head_dim)
        norm = getattr(self, f"{kind}_norm_swiftkv", None)
        return (out if norm is None else norm(out)).transpose(1, 2)

    def swiftkv_query(self, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """The student's query (rotary applied) from this layer's own normed input."""
        return apply_rope(self._heads("q", hidden_states), *position_embeddings)

    def swiftkv_cache_entry(
        self, normed_cutoff_state: torch.Tensor, position_embeddings, shifted: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What this group leader stores in the KV cache for every token, from ``norm_swiftkv(h)``:
        K (with rotary) and V. ``shifted``: on a token-shift layer, the normed cutoff states of the
        tokens before (``swiftkv.modeling.token_shift``)."""
        key = apply_rope(self._heads("k", normed_cutoff_state, shifted), *position_embeddings)
        return key, self._heads("v", normed_cutoff_state, shifted)

    def swiftkv_expand(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V the group's layers attend to, from the cache entries (past + new tokens)."""
        return key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings,
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
        query = self.swiftkv_query(hidden_states, position_embeddings)
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
            # Qwen2/Qwen3 keep a per-layer window, Mistral a model-wide one, Llama none.
            sliding_window=getattr(self, "sliding_window", getattr(self.config, "sliding_window", None)),
            **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
