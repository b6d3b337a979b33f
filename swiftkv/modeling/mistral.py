"""Mistral with SwiftKV (``model_type: mistral_swiftkv``): the model-wide sliding window comes with
the family's own classes."""

from huggingface_hub.dataclasses import strict
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralForCausalLM, MistralModel

from swiftkv.config import SwiftKVFields
from swiftkv.modeling.attention import SwiftKVAttentionMixin
from swiftkv.modeling.model import SwiftKVForCausalLMMixin, SwiftKVModelMixin


@strict
class MistralSwiftKVConfig(SwiftKVFields, MistralConfig):
    model_type = "mistral_swiftkv"


class MistralSwiftKVAttention(SwiftKVAttentionMixin, MistralAttention):
    pass


class MistralSwiftKVModel(SwiftKVModelMixin, MistralModel):
    config_class = MistralSwiftKVConfig
    attention_cls = MistralSwiftKVAttention


class MistralSwiftKVForCausalLM(SwiftKVForCausalLMMixin, MistralForCausalLM):
    config_class = MistralSwiftKVConfig
    model_cls = MistralSwiftKVModel
