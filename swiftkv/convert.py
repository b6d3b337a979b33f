"""Base checkpoint -> SwiftKV checkpoint, in the published SwiftKV layout (SPEC.md).

Initialisation before distillation: ``norm_swiftkv`` from layer c's ``input_layernorm``,
``q_proj_swiftkv`` a copy of ``q_proj``, a group leader's ``k/v_proj_swiftkv`` the mean of its
group's ``k/v_proj`` (biases alike). With that init and g = 1 the student's K/V of layer j are
those of a teacher whose layer j read the cutoff state: the distillation starts from there.

A safetensors base is converted without loading it: only the tensors the initialisation reads are
loaded, and the SwiftKV tensors are written as one more shard beside the base's own shards
(``swiftkv.checkpoint_files``). Other formats are loaded whole and saved with ``save_pretrained``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from swiftkv.checkpoint_files import ShardedTensors, has_safetensors, write_checkpoint
from swiftkv.config import check_swiftkv_shape, cutoff_from_fraction, default_cutoff
from swiftkv.model_source import resolve_model
from swiftkv.modeling import FAMILIES
from swiftkv.modeling.attention import is_group_leader

log = logging.getLogger(__name__)


def swiftkv_initial_weights(
    state: dict[str, torch.Tensor], num_layers: int, num_key_value_layers: int, key_value_group_size: int
) -> dict[str, torch.Tensor]:
    """The SwiftKV weights initialised from a base model's state dict."""
    c, g = num_key_value_layers, key_value_group_size
    new = {"model.norm_swiftkv.weight": state[f"model.layers.{c}.input_layernorm.weight"].clone()}
    for j in range(c, num_layers):
        attn = f"model.layers.{j}.self_attn"
        for kind in ("weight", "bias"):
            if f"{attn}.q_proj.{kind}" not in state:
                continue
            new[f"{attn}.q_proj_swiftkv.{kind}"] = state[f"{attn}.q_proj.{kind}"].clone()
            if is_group_leader(j, c, g):
                for proj in ("k_proj", "v_proj"):
                    group = [state[f"model.layers.{i}.self_attn.{proj}.{kind}"] for i in range(j, j + g)]
                    mean = torch.stack(group).float().mean(0).to(group[0].dtype)
                    new[f"{attn}.{proj}_swiftkv.{kind}"] = mean
    return new


def swiftkv_config(
    base: PretrainedConfig, num_key_value_layers: int | None = None, key_value_group_size: int = 1
) -> PretrainedConfig:
    """The SwiftKV config (student on) of a base model's config; the cutoff defaults to 50% SwiftKV."""
    family = base.model_type
    if family not in FAMILIES:
        hint = " (it is already a SwiftKV model)" if family.endswith("_swiftkv") else ""
        raise ValueError(
            f"model family {family!r} is not supported{hint}; SwiftKV supports: {', '.join(FAMILIES)}"
        )
    config_cls, model_cls = FAMILIES[family]
    num_layers = base.num_hidden_layers
    c = default_cutoff(num_layers) if num_key_value_layers is None else num_key_value_layers
    check_swiftkv_shape(num_layers, c, key_value_group_size)
    fields = base.to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        fields.pop(key, None)
    config = config_cls(**fields, swiftkv=True, num_key_value_layers=c, key_value_group_size=key_value_group_size)
    config.architectures = [model_cls.__name__]
    return config


def convert_model(
    base: PreTrainedModel, num_key_value_layers: int | None = None, key_value_group_size: int = 1
) -> PreTrainedModel:
    """A SwiftKV model (student on) holding ``base``'s weights plus the initialised SwiftKV weights.

    The base weights are shared with ``base``, not copied: one copy of the model sits in memory.
    """
    config = swiftkv_config(base.config, num_key_value_layers, key_value_group_size)
    _, model_cls = FAMILIES[base.config.model_type]
    state = base.state_dict()
    state.update(swiftkv_initial_weights(state, config.num_hidden_layers, config.num_key_value_layers,
                                         key_value_group_size))
    with torch.device("meta"):  # no second copy of the weights, no random init
        model = model_cls(config)
    model.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (rotary inv_freq) are not in the state dict: take the base model's.
    for name, buffer in base.named_buffers():
        module_name, _, buffer_name = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(buffer_name, buffer, persistent=False)
    model.tie_weights()
    model.generation_config = base.generation_config
    return model.eval()


def _base_config(path: str) -> PretrainedConfig:
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{path} is a folder but has no config.json: not a Hugging Face checkpoint")
    try:
        return AutoConfig.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(f"could not load base checkpoint {path!r}: {err}") from err


def load_base_model(path: str, dtype: str | torch.dtype = "auto") -> PreTrainedModel:
    """Load a base checkpoint from a local folder or hub id (``swiftkv.model_source.resolve_model``
    turns any model reference into one), with a clear error if it is not a checkpoint."""
    _base_config(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as err:
        raise FileNotFoundError(f"could not load base checkpoint {path!r}: {err}") from err


def convert_checkpoint(
    base: str,
    out: str | Path,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    cutoff: float | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a SwiftKV checkpoint (safetensors, config, tokenizer, chat template) for ``base`` to ``out``.

    ``cutoff`` (a fraction of the layers) is an alternative to ``num_key_value_layers``.
    The folder appears whole or not at all: it is written beside ``out`` and renamed at the end.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {out} exists and is not empty (pass overwrite=True / --overwrite)")
    if cutoff is not None and num_key_value_layers is not None:
        raise ValueError("give either a cutoff fraction or num_key_value_layers, not both")
    path = resolve_model(base)
    base_config = _base_config(path)
    if cutoff is not None:
        num_key_value_layers = cutoff_from_fraction(base_config.num_hidden_layers, cutoff)
    config = swiftkv_config(base_config, num_key_value_layers, key_value_group_size)
    log.info("converting %s (%d layers) to SwiftKV at c=%d, g=%d", base, config.num_hidden_layers,
             config.num_key_value_layers, key_value_group_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if has_safetensors(path):  # shard by shard: the base is never loaded whole
            new = swiftkv_initial_weights(ShardedTensors(path), config.num_hidden_layers, config.num_key_value_layers,
                                          key_value_group_size)
            write_checkpoint(path, new, config, tmp)
        else:
            swift = convert_model(load_base_model(path), config.num_key_value_layers, key_value_group_size)
            swift.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out)
    return out
