"""Qwen2 with SwiftKV (``model_type: qwen2_swiftkv``): attention biases and per-layer sliding windows
come with the family's own classes."""

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2ForCausalLM, Qwen2Model

from swiftkv.config import SwiftKVFields
from swiftkv.modeling.attention import SwiftKVAttentionMixin
from swiftkv.modeling.model import SwiftKVForCausalLMMixin, SwiftKVModelMixin


@strict
class Qwen2SwiftKVConfig(SwiftKVFields, Qwen2Config):
    model_type = "qwen2_swiftkv"


class Qwen2SwiftKVAttention(SwiftKVAttentionMixin, Qwen2Attention):
    pass


class Qwen2SwiftKVModel(SwiftKVModelMixin, Qwen2Model):
    config_class = Qwen2SwiftKVConfig
    attention_cls = Qwen2SwiftKVAttention


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLMMixin, Qwen2ForCausalLM):
    config_class = Qwen2SwiftKVConfig
    model_cls = Qwen2SwiftKVModel
