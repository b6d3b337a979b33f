"""Shapes the vLLM SwiftKV model is built from: heads per tensor-parallel rank, the cutoff, the
AcrossKV groups and the family's biases, derived once from the Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from transformers import PretrainedConfig
from vllm.model_executor.layers.rotary_embedding import get_rope

from swiftkv.config import attention_head_dim, check_swiftkv_shape, has_qk_norm, qkv_has_bias, shift_layers
from swiftkv.modeling import FAMILIES

# The SwiftKV model types the plugin serves: every family of swiftkv.modeling.
SERVED_MODEL_TYPES = tuple(config_cls.model_type for config_cls, _ in FAMILIES.values())


@dataclass(frozen=True)
class HeadLayout:
    """Attention heads of one layer, in total and on this tensor-parallel rank."""

    total_num_heads: int
    """Query heads of the whole model layer."""
    total_num_kv_heads: int
    """Key/value heads of the whole model layer."""
    head_dim: int
    """Width of one head."""
    tp_size: int
    """Tensor-parallel ranks the heads are split over."""

    @property
    def num_heads(self) -> int:
        return self.total_num_heads // self.tp_size

    @property
    def num_kv_heads(self) -> int:
        # Fewer KV heads than ranks: each rank keeps a replica of one (as QKVParallelLinear does).
        return max(1, self.total_num_kv_heads // self.tp_size)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class SwiftKVLayout:
    """Where each layer's K/V come from, and the per-family details the layers need."""

    heads: HeadLayout
    """Attention heads per layer."""
    num_layers: int
    """``L``: decoder layers."""
    num_kv_layers: int
    """Layers that compute their own K/V on every token: the cutoff ``c``, or ``L`` without SwiftKV."""
    group_size: int
    """AcrossKV group size ``g`` (1 = every later layer has its own K/V projection)."""
    qkv_bias: bool
    """Whether the q/k/v projections (and their SwiftKV copies) carry biases."""
    o_proj_bias: bool
    """Whether the output projection carries a bias."""
    mlp_bias: bool
    """Whether the MLP projections carry biases."""
    qk_norm: bool
    """Whether each query and key head is RMS-normed before rotary (Qwen3)."""
    max_position: int
    """Largest position the rotary embedding is built for."""
    rope_parameters: dict | None
    """The config's rotary parameters (theta, scaling)."""

    @classmethod
    def from_config(cls, config: PretrainedConfig, tp_size: int) -> SwiftKVLayout:
        if config.model_type not in SERVED_MODEL_TYPES:
            raise ValueError(
                f"model_type {config.model_type!r} is not served by the SwiftKV vLLM plugin; "
                f"supported: {sorted(SERVED_MODEL_TYPES)}"
            )
        num_layers = config.num_hidden_layers
        if config.swiftkv:
            check_swiftkv_shape(num_layers, config.num_key_value_layers, config.key_value_group_size)
        if shift_layers(config):
            raise ValueError(
                f"key_value_shift_layers={shift_layers(config)}: the token shift (docs/distillation.md) is not "
                "served by the SwiftKV vLLM plugin yet; serve a checkpoint without it, or run it with "
                "Hugging Face transformers"
            )
        heads = HeadLayout(
            total_num_heads=config.num_attention_heads,
            total_num_kv_heads=config.num_key_value_heads,
            head_dim=attention_head_dim(config),
            tp_size=tp_size,
        )
        attention_bias = bool(getattr(config, "attention_bias", False))
        return cls(
            heads=heads,
            num_layers=num_layers,
            num_kv_layers=config.num_key_value_layers if config.swiftkv else num_layers,
            group_size=config.key_value_group_size if config.swiftkv else 1,
            qkv_bias=qkv_has_bias(config),
            o_proj_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=has_qk_norm(config),
            max_position=getattr(config, "max_position_embeddings", 8192),
            rope_parameters=getattr(config, "rope_parameters", None),
        )

    @property
    def leaders(self) -> list[int]:
        """The first layer of each AcrossKV group: the layers whose ``k/v_proj_swiftkv`` exist."""
        return list(range(self.num_kv_layers, self.num_layers, self.group_size))

    @property
    def num_groups(self) -> int:
        return len(self.leaders)

    def group_of(self, layer_idx: int) -> int:
        """Index of the AcrossKV group of a layer after the cutoff."""
        return (layer_idx - self.num_kv_layers) // self.group_size

    def rotary_emb(self) -> nn.Module:
        """The rotary embedding (vLLM caches one instance per shape and parameters)."""
        return get_rope(
            self.heads.head_dim,
            max_position=self.max_position,
            rope_parameters=self.rope_parameters,
            is_neox_style=True,
        )
