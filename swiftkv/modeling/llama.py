"""Llama with SwiftKV (``model_type: llama_swiftkv``)."""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaForCausalLM, LlamaModel

from swiftkv.config import SwiftKVFields
from swiftkv.modeling.attention import SwiftKVAttentionMixin
from swiftkv.modeling.model import SwiftKVForCausalLMMixin, SwiftKVModelMixin


@strict
class LlamaSwiftKVConfig(SwiftKVFields, LlamaConfig):
    model_type = "llama_swiftkv"


class LlamaSwiftKVAttention(SwiftKVAttentionMixin, LlamaAttention):
    pass


class LlamaSwiftKVModel(SwiftKVModelMixin, LlamaModel):
    config_class = LlamaSwiftKVConfig
    attention_cls = LlamaSwiftKVAttention


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLMMixin, LlamaForCausalLM):
    config_class = LlamaSwiftKVConfig
    model_cls = LlamaSwiftKVModel
