"""Checkpoint names (SPEC.md's layout, as the published SwiftKV checkpoints use it) to parameters of
the vLLM SwiftKV model.

vLLM's stock Llama loader maps ``.q_proj`` onto ``qkv_proj`` by substring, which would also catch
``q_proj_swiftkv``; this mapping matches whole names instead. DeepSeek-V2 (latent attention) keeps
vLLM's own loading (expert mapping, fused projections): here only which of its tensors are loaded
(``keeps_latent_tensor``) and the SwiftKV tensors' checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from swiftkv.modeling.deepseek_v2 import DeepseekV2SwiftKVAttention
from swiftkv.vllm.layout import SwiftKVLayout

_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj(_swiftkv)?\.(weight|bias)")
_HEAD_NORM = re.compile(r"model\.layers\.(\d+)\.self_attn\.([qk])_norm(_swiftkv)?\.weight")  # Qwen3
_MLP = re.compile(r"(model\.layers\.\d+\.mlp)\.(gate|up)_proj\.(weight|bias)")

Target = tuple[str, str | int | None]  # (parameter name, shard id for fused parameters)


def target_of(name: str, layout: SwiftKVLayout, swiftkv: bool) -> Target | None:
    """The parameter (and shard) a checkpoint tensor loads into; ``None`` for tensors the serving
    model does not use: the teacher's q/k/v of layers after the cutoff, and the SwiftKV weights
    of a checkpoint served as its base model (``swiftkv: false``)."""
    if "rotary_emb.inv_freq" in name:
        return None
    if name == "model.norm_swiftkv.weight":
        return (name, None) if swiftkv else None
    if match := _MLP.fullmatch(name):
        prefix, which, kind = match.groups()
        return f"{prefix}.gate_up_proj.{kind}", 0 if which == "gate" else 1
    if match := _HEAD_NORM.fullmatch(name):  # loaded under their own names, where the layer uses them
        layer, which, swiftkv_copy = int(match[1]), match[2], match[3] is not None
        if swiftkv_copy != (layer >= layout.num_kv_layers):
            return None  # a later layer's teacher norm, or a SwiftKV copy served as the base model
        if swiftkv_copy and which == "k":
            _check_leader(name, layer, layout)
        return name, None
    if not (match := _ATTN.fullmatch(name)):
        return name, None
    layer, which, swiftkv_copy, kind = int(match[1]), match[2], match[3] is not None, match[4]
    if layer < layout.num_kv_layers:
        return None if swiftkv_copy else (f"model.layers.{layer}.self_attn.qkv_proj.{kind}", which)
    if not swiftkv_copy:
        return None  # teacher q/k/v of a later layer: the student never uses them
    if which == "q":
        return name, None
    _check_leader(name, layer, layout)
    group = layout.group_of(layer)
    return f"model.kv_proj_swiftkv.{kind}", group if which == "k" else layout.num_groups + group


def _check_leader(name: str, layer: int, layout: SwiftKVLayout) -> None:
    if layer not in layout.leaders:
        raise ValueError(
            f"checkpoint tensor {name} belongs to layer {layer}, which is not an AcrossKV group leader "
            f"for num_key_value_layers={layout.num_kv_layers}, key_value_group_size={layout.group_size}: "
            "the checkpoint does not match its config"
        )


def swiftkv_tensor_shape(name: str, layout: SwiftKVLayout, hidden_size: int) -> tuple[int, ...] | None:
    """The whole (unsharded) shape the config gives a SwiftKV tensor; ``None`` for other tensors.
    vLLM's sharded loaders cut a tensor that is too large to the parameter's size without a word,
    so our tensors are checked against the config before they are loaded."""
    if name == "model.norm_swiftkv.weight":
        return (hidden_size,)
    if (match := _HEAD_NORM.fullmatch(name)) and match[3] is not None:
        return (layout.heads.head_dim,)
    match = _ATTN.fullmatch(name)
    if match is None or match[3] is None:
        return None
    heads = layout.heads.total_num_heads if match[2] == "q" else layout.heads.total_num_kv_heads
    rows = heads * layout.heads.head_dim
    return (rows, hidden_size) if match[4] == "weight" else (rows,)


def load_swiftkv_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], layout: SwiftKVLayout
) -> set[str]:
    """Load checkpoint tensors into ``model``; returns the names of the parameters loaded (vLLM
    then reports any parameter left unloaded)."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    seen: set[str] = set()
    for name, tensor in weights:
        seen.add(name)
        if tied and name.startswith("lm_head."):
            continue
        target = target_of(name, layout, model.config.swiftkv)
        if target is None:
            continue
        param_name, shard = target
        if param_name not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in {type(model).__name__} ({param_name})")
        want = swiftkv_tensor_shape(name, layout, model.config.hidden_size)
        if want is not None and tuple(tensor.shape) != want:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, but its config.json calls for "
                f"{want}: the checkpoint does not match its config"
            )
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except (AssertionError, RuntimeError) as err:  # vLLM's loaders do not name the tensor
            raise ValueError(
                f"checkpoint tensor {name} of shape {tuple(tensor.shape)} could not be loaded into {param_name} "
                f"({err}); does the checkpoint match its config?"
            ) from err
        loaded.add(param_name)
    if model.config.swiftkv:
        _check_swiftkv_tensors(seen, layout)
    return loaded


def _check_swiftkv_tensors(seen: set[str], layout: SwiftKVLayout) -> None:
    """vLLM reports parameters never loaded, but not a missing shard of a fused one (one group's
    K/V, or its bias, inside ``kv_proj_swiftkv``): check the SwiftKV tensors the config calls for by
    name."""
    expected = {"model.norm_swiftkv.weight"}
    kinds = ("weight", "bias") if layout.qkv_bias else ("weight",)  # a missing bias would load as garbage
    for layer in range(layout.num_kv_layers, layout.num_layers):
        attn = f"model.layers.{layer}.self_attn"
        projections = ("q", "k", "v") if layer in layout.leaders else ("q",)
        expected |= {f"{attn}.{p}_proj_swiftkv.{kind}" for p in projections for kind in kinds}
        if layout.qk_norm:
            expected |= {f"{attn}.{p}_norm_swiftkv.weight" for p in projections if p != "v"}
    _check_present(seen, expected, layout)


def _check_present(seen: set[str], expected: set[str], layout: SwiftKVLayout) -> None:
    if missing := sorted(expected - seen):
        raise ValueError(
            f"the checkpoint lacks {len(missing)} SwiftKV tensor(s) its config calls for "
            f"(num_key_value_layers={layout.num_kv_layers}, key_value_group_size={layout.group_size}), "
            f"e.g. {missing[:3]}: was it converted with other settings?"
        )


# DeepSeek-V2 (latent attention): the attention modules that SwiftKV copies, as the HF model names them.
_LATENT_QUERY = DeepseekV2SwiftKVAttention.query_modules
_LATENT_KEY_VALUE = DeepseekV2SwiftKVAttention.key_value_modules
_LATENT_ATTN = re.compile(
    rf"model\.layers\.(\d+)\.self_attn\.({'|'.join(_LATENT_QUERY + _LATENT_KEY_VALUE)})(_swiftkv)?\.weight"
)


def _latent_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The whole (unsharded) shape of each latent-attention module's weight."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    q_lora = getattr(config, "q_lora_rank", None)
    return {
        "q_proj": (heads * qk_head_dim, hidden),
        "q_a_proj": (q_lora, hidden),
        "q_a_layernorm": (q_lora,),
        "q_b_proj": (heads * qk_head_dim, q_lora),
        "kv_a_proj_with_mqa": (config.kv_lora_rank + config.qk_rope_head_dim, hidden),
        "kv_a_layernorm": (config.kv_lora_rank,),
        "kv_b_proj": (heads * (config.qk_nope_head_dim + config.v_head_dim), config.kv_lora_rank),
    }


def keeps_latent_tensor(name: str, layout: SwiftKVLayout, config: PretrainedConfig, shape: torch.Size) -> bool:
    """Whether a DeepSeek-V2 checkpoint tensor is loaded (under its own name; vLLM's DeepSeek-V2
    loading maps experts and fused projections): not the teacher's attention of layers after the
    cutoff, nor the SwiftKV tensors of a checkpoint served as its base model. SwiftKV tensors are
    checked against the config (vLLM's sharded loaders would cut a tensor that is too large)."""
    if name == "model.norm_swiftkv.weight":
        return bool(config.swiftkv)
    if not (match := _LATENT_ATTN.fullmatch(name)):
        return True
    layer, module, swiftkv_copy = int(match[1]), match[2], match[3] is not None
    if swiftkv_copy != (layer >= layout.num_kv_layers):
        return False  # a later layer's teacher attention, or a SwiftKV copy served as the base model
    if swiftkv_copy:
        if module in _LATENT_KEY_VALUE:
            _check_leader(name, layer, layout)
        if tuple(shape) != (want := _latent_shapes(config)[module]):
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(shape)}, but its config.json calls for "
                f"{want}: the checkpoint does not match its config"
            )
    return True


def check_latent_swiftkv_tensors(seen: set[str], layout: SwiftKVLayout, config: PretrainedConfig) -> None:
    """Every SwiftKV tensor a DeepSeek-V2 config calls for is in the checkpoint (named in the error)."""
    query = ("q_proj",) if getattr(config, "q_lora_rank", None) is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
    expected = {"model.norm_swiftkv.weight"}
    for layer in range(layout.num_kv_layers, layout.num_layers):
        modules = query + (_LATENT_KEY_VALUE if layer in layout.leaders else ())
        expected |= {f"model.layers.{layer}.self_attn.{m}_swiftkv.weight" for m in modules}
    _check_present(seen, expected, layout)
