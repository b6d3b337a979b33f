"""Qwen3 with SwiftKV (``model_type: qwen3_swiftkv``).

Qwen3 normalises each query and key head (``q_norm``/``k_norm``, RMSNorm over ``head_dim``, before
rotary). The SwiftKV query goes through ``q_norm_swiftkv`` on every layer after the cutoff and the
leader's SwiftKV key through ``k_norm_swiftkv``: own copies, trained with the other SwiftKV weights
and initialised from the layer's ``q_norm`` and the group's ``k_norm`` (a group mean, as for
``k_proj``). At that initialisation this is the layer's own ``q_norm`` and, with g = 1, the
leader's own ``k_norm``. The names are those of the reference training code's Qwen3 SwiftKV branch.
"""

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3ForCausalLM, Qwen3Model

from swiftkv.config import SwiftKVFields
from swiftkv.modeling.attention import SwiftKVAttentionMixin
from swiftkv.modeling.model import SwiftKVForCausalLMMixin, SwiftKVModelMixin


@strict
class Qwen3SwiftKVConfig(SwiftKVFields, Qwen3Config):
    model_type = "qwen3_swiftkv"


class Qwen3SwiftKVAttention(SwiftKVAttentionMixin, Qwen3Attention):
    query_modules = ("q_proj", "q_norm")
    key_value_modules = ("k_proj", "v_proj", "k_norm")


class Qwen3SwiftKVModel(SwiftKVModelMixin, Qwen3Model):
    config_class = Qwen3SwiftKVConfig
    attention_cls = Qwen3SwiftKVAttention


class Qwen3SwiftKVForCausalLM(SwiftKVForCausalLMMixin, Qwen3ForCausalLM):
    config_class = Qwen3SwiftKVConfig
    model_cls = Qwen3SwiftKVModel
