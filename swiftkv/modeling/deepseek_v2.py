"""DeepSeek-V2 with SwiftKV (``model_type: deepseek_v2_swiftkv``), on transformers' own ``deepseek_v2``
classes (multi-head latent attention, mixture of experts), with the reference training code's
tensor names.

Latent attention caches, per token, one normed latent ``c_kv`` (``kv_lora_rank`` wide) and one
rotary key part ``k_pe`` shared by all heads; ``kv_b_proj`` expands the latent into every head's
key (non-rotary part) and value. SwiftKV on it, for layers ``j >= c``:
- the query: ``q_proj_swiftkv`` (or ``q_a_proj_swiftkv`` -> ``q_a_layernorm_swiftkv`` ->
  ``q_b_proj_swiftkv`` where the model has a query LoRA rank) on the layer's own normed input;
- an AcrossKV group leader writes ``kv_a_layernorm_swiftkv`` of the latent part of
  ``kv_a_proj_with_mqa_swiftkv(norm_swiftkv(h))`` and the rotary part (rotary at each token's
  position) into the cache, and expands it with ``kv_b_proj_swiftkv``; every layer of the group
  attends to that expansion.
The mixture-of-experts MLPs after the cutoff are skipped for prompt tokens like any MLP.
"""

import torch
from huggingface_hub.dataclasses import strict
from transformers import DeepseekV2Config
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
    DeepseekV2Attention,
    DeepseekV2ForCausalLM,
    DeepseekV2Model,
    DeepseekV2PreTrainedModel,
)

from swiftkv.config import SwiftKVFields
from swiftkv.modeling.attention import SwiftKVAttentionMixin
from swiftkv.modeling.model import SwiftKVForCausalLMMixin, SwiftKVModelMixin


@strict
class DeepseekV2SwiftKVConfig(SwiftKVFields, DeepseekV2Config):
    model_type = "deepseek_v2_swiftkv"


# transformers keeps the experts of a layer as fused tensors and maps the checkpoints' per-expert
# tensors onto them (and back on saving) by model_type: the SwiftKV type takes the base's mapping,
# so checkpoints keep the published per-expert layout (without it the experts load as random).
register_checkpoint_conversion_mapping(
    DeepseekV2SwiftKVConfig.model_type, get_checkpoint_conversion_mapping("deepseek_v2"), overwrite=True
)


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2's rotary embedding (interleaved pairs as complex numbers) of ``[batch, heads, tokens, dim]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis.unsqueeze(1)).flatten(3).type_as(x)


class DeepseekV2SwiftKVAttention(SwiftKVAttentionMixin, DeepseekV2Attention):
    # A layer has q_proj or the q_a/q_b pair (query LoRA rank): the one it has gets its copy.
    query_modules = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj")
    key_value_modules = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj")

    def swiftkv_query(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj_swiftkv(hidden_states)
        else:
            q = self.q_b_proj_swiftkv(self.q_a_layernorm_swiftkv(self.q_a_proj_swiftkv(hidden_states)))
        q = q.view(*hidden_states.shape[:-1], -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, _rotate(q_pe, position_embeddings)], dim=-1)

    def swiftkv_cache_entry(
        self, normed_cutoff_state: torch.Tensor, position_embeddings: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The latent and the rotary key part, each ``[batch, 1, tokens, width]`` (as the family caches them)."""
        batch, tokens = normed_cutoff_state.shape[:-1]
        latent, k_pe = self.kv_a_proj_with_mqa_swiftkv(normed_cutoff_state).split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        latent = self.kv_a_layernorm_swiftkv(latent).view(batch, 1, tokens, self.kv_lora_rank)
        return latent, _rotate(k_pe.view(batch, 1, tokens, self.qk_rope_head_dim), position_embeddings)

    def swiftkv_expand(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every head's key (``[non-rotary | rotary]``) and value, through ``kv_b_proj_swiftkv``."""
        batch, _, tokens, _ = latent.shape
        kv = self.kv_b_proj_swiftkv(latent).view(batch, tokens, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, value = kv.transpose(1, 2).split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        return torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1), value


class _BaseExperts:
    """The experts are the base family's, so they take the implementations it takes (``eager``,
    ``grouped_mm``, ...). transformers decides that by reading a class's module source, which here
    has no experts; its cached answer for a base class would otherwise leak to ours, so that the
    implementation chosen would depend on which class was built first."""

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        return DeepseekV2PreTrainedModel._can_set_experts_implementation()


class DeepseekV2SwiftKVModel(_BaseExperts, SwiftKVModelMixin, DeepseekV2Model):
    config_class = DeepseekV2SwiftKVConfig
    attention_cls = DeepseekV2SwiftKVAttention
    output_cls = MoeModelOutputWithPast  # the causal LM reads its router_logits


class DeepseekV2SwiftKVForCausalLM(_BaseExperts, SwiftKVForCausalLMMixin, DeepseekV2ForCausalLM):
    config_class = DeepseekV2SwiftKVConfig
    model_cls = DeepseekV2SwiftKVModel
