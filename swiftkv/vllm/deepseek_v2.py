"""The SwiftKV decoder for vLLM on DeepSeek-V2 (multi-head latent attention, mixture of experts):
``DeepseekV2SwiftKVForCausalLM``, built from vLLM's own DeepSeek-V2 layers.

Latent attention caches, per token and layer, one normed latent (``kv_lora_rank`` wide) and one
rotary key part ``k_pe``; ``kv_b_proj`` expands the latent into every head's key and value. With
``config.swiftkv`` (cutoff ``c``, AcrossKV group size ``g``), per engine step:
  1. every scheduled token runs the embedding and vLLM's ``DeepseekV2DecoderLayer`` ``0..c-1``
     (``DeepseekV2SwiftKVPrefill``); from ``norm_swiftkv`` of the state entering layer ``c``, each
     group leader's ``kv_a_proj_with_mqa_swiftkv`` gives the latent (through
     ``kv_a_layernorm_swiftkv``) and ``k_pe`` (rotary applied), written into the group's MLA cache;
  2. only the logits rows run layers ``c..L-1`` and the final norm (``DeepseekV2SwiftKVDecode``):
     queries from ``q_proj_swiftkv`` (or the ``q_a``/``q_b`` pair with a query LoRA rank), attention
     over the group's cache with the leader's ``kv_b_proj_swiftkv`` (absorbed, as vLLM's MLA layer
     does), then the layer's own MoE or MLP.
Each group's cache belongs to a weightless ``MLAAttention`` owner; the later layers' attention
(``MLACacheReader``) reads it and never writes it, so vLLM allocates MLA caches for
``c + (L - c) / g`` layers. With ``swiftkv: false`` every layer is vLLM's own: the plain base model.

Layers ``>= c`` that are not logits rows still need the group's latent and ``k_pe`` when the early
exit is not armed (profiling, warm-up, prefill skipping off): vLLM's MLA attends to prefill rows
over the latent passed in, not over the cache, so the decode unit is handed them for its rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2MLP,
    DeepseekV2Model,
    DeepseekV2MoE,
)
from vllm.model_executor.models.utils import AutoWeightsLoader

from swiftkv.config import is_moe_layer
from swiftkv.vllm.kv_internals import MLACacheReader, compile_unit, write_mla_cache
from swiftkv.vllm.layout import SwiftKVLayout
from swiftkv.vllm.model import TOKEN_ARGS, SwiftKVForCausalLM, is_swiftkv, run_layers, run_on_logits_rows
from swiftkv.vllm.weights import check_latent_swiftkv_tensors, keeps_latent_tensor


def rotate(rotary_emb: nn.Module, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[tokens, heads, rope_dim]``) with rotary at its tokens' positions. DeepSeek's scaling
    rotary asserts that a key comes along: a one-head throwaway key does."""
    x, _ = rotary_emb(positions, x, torch.zeros_like(x[:, :1]))
    return x


class DeepseekV2SwiftKVAttention(nn.Module):
    """Latent attention of a layer after the cutoff: its own queries (``*_swiftkv``), its group's
    cache. A group leader also holds the group's ``kv_a_proj_with_mqa_swiftkv``,
    ``kv_a_layernorm_swiftkv`` (run by the prefill unit) and ``kv_b_proj_swiftkv``."""

    def __init__(
        self, vllm_config: VllmConfig, layout: SwiftKVLayout, layer_idx: int, prefix: str,
        cache: MLAAttention, reference: nn.Module,
    ) -> None:
        super().__init__()
        config, quant_config = vllm_config.model_config.hf_config, vllm_config.quant_config
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.num_heads = config.num_attention_heads // layout.heads.tp_size
        self.q_lora_rank = config.q_lora_rank
        if self.q_lora_rank is None:
            self.q_proj_swiftkv = ColumnParallelLinear(
                config.hidden_size, config.num_attention_heads * qk_head_dim, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.q_proj_swiftkv",
            )
        else:
            self.q_a_proj_swiftkv = ReplicatedLinear(
                config.hidden_size, self.q_lora_rank, bias=False, quant_config=quant_config,
                prefix=f"{prefix}.q_a_proj_swiftkv",
            )
            self.q_a_layernorm_swiftkv = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj_swiftkv = ColumnParallelLinear(
                self.q_lora_rank, config.num_attention_heads * qk_head_dim, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.q_b_proj_swiftkv",
            )
        if layer_idx in layout.leaders:
            self.kv_a_proj_with_mqa_swiftkv = ReplicatedLinear(
                config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa_swiftkv",
            )
            self.kv_a_layernorm_swiftkv = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
            # Before `attn`: the parameter is named after this module, not the readers that share it.
            self.kv_b_proj_swiftkv = cache.kv_b_proj
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.v_head_dim, config.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        # The same rotary and softmax scale as vLLM's own layers (its YaRN rewrite and mscale^2).
        self.rotary_emb = reference.rotary_emb
        self.attn = MLACacheReader(
            kv_sharing_target_layer_name=cache.layer_name,
            num_heads=self.num_heads, scale=reference.scaling, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, kv_b_proj=cache.kv_b_proj, cache_config=vllm_config.cache_config,
            quant_config=quant_config, prefix=f"{prefix}.attn",
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        if self.q_lora_rank is None:
            q, _ = self.q_proj_swiftkv(hidden_states)
        else:
            q_a, _ = self.q_a_proj_swiftkv(hidden_states)
            q, _ = self.q_b_proj_swiftkv(self.q_a_layernorm_swiftkv(q_a))
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_pe = rotate(self.rotary_emb, positions, q[..., self.qk_nope_head_dim :])
        q = torch.cat([q[..., : self.qk_nope_head_dim], q_pe], dim=-1)
        out = self.attn(q, latent, k_pe, output_shape=(q.shape[0], self.num_heads * self.v_head_dim))
        out, _ = self.o_proj(out)
        return out


class DeepseekV2SwiftKVDecoderLayer(nn.Module):
    """A layer after the cutoff: SwiftKV latent attention, then the layer's own MoE or MLP."""

    def __init__(self, vllm_config: VllmConfig, layout: SwiftKVLayout, layer_idx: int, prefix: str,
                 cache: MLAAttention, reference: nn.Module) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = DeepseekV2SwiftKVAttention(
            vllm_config, layout, layer_idx, f"{prefix}.self_attn", cache, reference
        )
        if is_moe_layer(config, layer_idx):  # as vLLM's own layers before the cutoff decide
            self.mlp = DeepseekV2MoE(
                config=config, parallel_config=vllm_config.parallel_config, quant_config=vllm_config.quant_config,
                prefix=f"{prefix}.mlp", apply_routed_scale_to_output=True,
            )
        else:
            self.mlp = DeepseekV2MLP(
                hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                hidden_act=config.hidden_act, quant_config=vllm_config.quant_config, prefix=f"{prefix}.mlp",
            )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
        latent: torch.Tensor, k_pe: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, latent, k_pe)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims=TOKEN_ARGS, enable_if=is_swiftkv)
class DeepseekV2SwiftKVPrefill(nn.Module):
    """Runs on every scheduled token: embedding, layers ``0..c-1``, and every group's latent and
    ``k_pe`` (rotary applied), ``[tokens, groups, kv_lora_rank + rope_dim]``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: DeepseekV2SwiftKVModel) -> None:
        super().__init__()
        c = model.layout.num_kv_layers
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers[:c]
        self.norm_swiftkv = model.norm_swiftkv
        self.kv_lora_rank = model.config.kv_lora_rank
        # A plain list: the modules stay the leaders'.
        self.leaders = [model.layers[j].self_attn for j in model.layout.leaders]
        self.rotary_emb = model.layers[0].self_attn.rotary_emb

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, inputs_embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = run_layers(self.layers, positions, hidden)
        normed = self.norm_swiftkv(hidden)
        latents, k_pes = [], []
        for leader in self.leaders:
            kv, _ = leader.kv_a_proj_with_mqa_swiftkv(normed)
            latent, k_pe = kv.split([self.kv_lora_rank, kv.shape[-1] - self.kv_lora_rank], dim=-1)
            latents.append(leader.kv_a_layernorm_swiftkv(latent))
            k_pes.append(k_pe)
        k_pe = rotate(self.rotary_emb, positions, torch.stack(k_pes, dim=1))  # every group in one call
        return hidden, torch.cat([torch.stack(latents, dim=1), k_pe], dim=-1)


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden_states": 0, "group_kv": 0}, enable_if=is_swiftkv)
class DeepseekV2SwiftKVDecode(nn.Module):
    """Runs on the logits rows only: layers ``c..L-1`` (each with its group's latent and ``k_pe``
    at those rows) and the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: DeepseekV2SwiftKVModel) -> None:
        super().__init__()
        self.layers = model.layers[model.layout.num_kv_layers :]
        self.groups = [model.layout.group_of(j) for j in range(model.layout.num_kv_layers, model.layout.num_layers)]
        self.norm = model.norm
        self.kv_lora_rank = model.config.kv_lora_rank

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, group_kv: torch.Tensor) -> torch.Tensor:
        latent, k_pe = group_kv.split([self.kv_lora_rank, group_kv.shape[-1] - self.kv_lora_rank], dim=-1)
        residual = None
        for layer, group in zip(self.layers, self.groups, strict=True):
            hidden_states, residual = layer(
                positions, hidden_states, residual, latent[:, group], k_pe[:, group : group + 1]
            )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


@support_torch_compile(dynamic_arg_dims=TOKEN_ARGS, enable_if=lambda vllm_config: not is_swiftkv(vllm_config))
class DeepseekV2SwiftKVModel(nn.Module):
    """The decoder: owns every weight; with SwiftKV on, runs them as the two units above with the
    group caches written in between (compiled as one unit only for the plain base model)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.layout = layout = SwiftKVLayout.from_config(config, vllm_config.parallel_config.tensor_parallel_size)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config
        )
        c = layout.num_kv_layers
        layers = [DeepseekV2DecoderLayer(vllm_config, prefix=f"{prefix}.layers.{j}") for j in range(c)]
        caches = []
        if config.swiftkv:
            self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            reference = layers[0].self_attn  # vLLM's own MLA layer: its rotary and softmax scale
            # One weightless cache owner per group (its kv_b_proj is the leader's kv_b_proj_swiftkv);
            # each name holds exactly one integer, the leader's index: vLLM orders caches by it.
            caches = [
                MLAAttention(
                    num_heads=reference.num_local_heads, scale=reference.scaling,
                    qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                    v_head_dim=config.v_head_dim, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                    kv_b_proj=ColumnParallelLinear(
                        config.kv_lora_rank, config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim),
                        bias=False, quant_config=vllm_config.quant_config,
                        prefix=f"{prefix}.layers.{leader}.self_attn.kv_b_proj_swiftkv",
                    ),
                    cache_config=vllm_config.cache_config, quant_config=vllm_config.quant_config,
                    prefix=f"{prefix}.layers.{leader}.self_attn.swiftkv_cache",
                )
                for leader in layout.leaders
            ]
            layers += [
                DeepseekV2SwiftKVDecoderLayer(
                    vllm_config, layout, j, f"{prefix}.layers.{j}", caches[layout.group_of(j)], reference
                )
                for j in range(c, config.num_hidden_layers)
            ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.swiftkv:
            # Registered after the layers, so that the shared kv_b_proj is named after its leader.
            self.group_caches = nn.ModuleList(caches)
            with compile_unit("swiftkv_prefill"):
                self.prefill = DeepseekV2SwiftKVPrefill(vllm_config=vllm_config, prefix=f"{prefix}.prefill", model=self)
            with compile_unit("swiftkv_decode"):
                self.decode = DeepseekV2SwiftKVDecode(vllm_config=vllm_config, prefix=f"{prefix}.decode", model=self)
            # Static inputs of the decode unit, so that CUDA graphs see fixed addresses.
            max_tokens, dtype = vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.dtype
            kv_width = config.kv_lora_rank + config.qk_rope_head_dim
            self.register_buffer("_rows_positions", torch.zeros(max_tokens, dtype=torch.int64), persistent=False)
            self.register_buffer("_rows_hidden", torch.zeros(max_tokens, config.hidden_size, dtype=dtype),
                                 persistent=False)
            self.register_buffer("_rows_kv", torch.zeros(max_tokens, len(caches), kv_width, dtype=dtype),
                                 persistent=False)
        # Read by vLLM's DeepSeek-V2 weight loading, which this model reuses.
        self.use_mha = False
        self.is_fused_shared_expert_enabled = False
        self.num_redundant_experts = vllm_config.parallel_config.eplb_config.num_redundant_experts

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not self.config.swiftkv:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            return self.norm(run_layers(self.layers, positions, hidden))

        hidden, group_kv = self.prefill(input_ids, positions, inputs_embeds)
        latent, k_pe = group_kv.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], dim=-1)
        for g, cache in enumerate(self.group_caches):
            write_mla_cache(cache, latent[:, g].contiguous(), k_pe[:, g : g + 1].contiguous())

        return run_on_logits_rows(
            self.decode, self.layers[-1].self_attn.attn, hidden, (positions, hidden, group_kv),
            (self._rows_positions, self._rows_hidden, self._rows_kv),
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return DeepseekV2Model.load_weights(self, weights)


class DeepseekV2SwiftKVForCausalLM(SwiftKVForCausalLM):
    """``DeepseekV2SwiftKVForCausalLM``: the DeepSeek-V2 SwiftKV decoder and vLLM's LM head."""

    model_cls = DeepseekV2SwiftKVModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        layout, seen = self.model.layout, set()
        tied = self.config.tie_word_embeddings

        def kept() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                seen.add(name)
                if not (tied and name.startswith("lm_head.")) and keeps_latent_tensor(
                    name, layout, self.config, tensor.shape
                ):
                    yield name, tensor

        loaded = AutoWeightsLoader(self).load_weights(kept())
        if self.config.swiftkv:
            check_latent_swiftkv_tensors(seen, layout, self.config)
        return loaded
