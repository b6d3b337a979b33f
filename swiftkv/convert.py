"""Base checkpoint -> SwiftKV checkpoint, in the published SwiftKV layout (SPEC.md).

Initialisation before distillation: ``norm_swiftkv`` from layer c's ``input_layernorm``,
``q_proj_swiftkv`` a copy of ``q_proj``, a group leader's ``k/v_proj_swiftkv`` the mean of its
group's ``k/v_proj`` (biases alike); likewise for every module a family has on those paths (Qwen3's
per-head q/k norms, DeepSeek-V2's latent-attention projections and norms). With that init and g = 1
the student's K/V of layer j are those of a teacher whose layer j read the cutoff state: the
distillation starts from there (and at c = L - 1 the student is exactly the teacher).

A safetensors base is converted without loading it: only the tensors the initialisation reads are
loaded, and the SwiftKV tensors are written as one more shard beside the base's own shards
(``swiftkv.checkpoint_files``). Other formats are loaded whole and saved with ``save_pretrained``.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from swiftkv.checkpoint_files import ShardedTensors, has_safetensors, write_checkpoint
from swiftkv.config import NO_SHIFT, TokenShift, check_swiftkv_shape, cutoff_from_fraction, default_cutoff, shift_layers
from swiftkv.file_modes import make_readable
from swiftkv.modeling import FAMILIES
from swiftkv.modeling.attention import is_group_leader

log = logging.getLogger(__name__)


def swiftkv_initial_weights(state: Mapping[str, torch.Tensor], config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The SwiftKV weights of the SwiftKV ``config`` initialised from a base model's state dict: each
    query module of a layer after the cutoff copied, each key/value module of a group leader the
    mean over its group (every tensor of the module: weight, bias), the modules being those the
    family's SwiftKV attention names."""
    c, g = config.num_key_value_layers, config.key_value_group_size
    attention_cls = FAMILIES[config.model_type.removesuffix("_swiftkv")][1].model_cls.attention_cls
    new = {"model.norm_swiftkv.weight": state[f"model.layers.{c}.input_layernorm.weight"].clone()}

    def init(j: int, module: str, group: range) -> None:
        for kind in ("weight", "bias"):
            sources = [f"model.layers.{i}.self_attn.{module}.{kind}" for i in group]
            if sources[0] in state:  # modules the layer lacks (DeepSeek's q_proj vs q_a_proj) are skipped
                tensors = [state[name] for name in sources]
                mean = torch.stack(tensors).float().mean(0).to(tensors[0].dtype)
                new[f"model.layers.{j}.self_attn.{module}_swiftkv.{kind}"] = mean

    for j in range(c, config.num_hidden_layers):
        for module in attention_cls.query_modules:
            init(j, module, range(j, j + 1))
        if is_group_leader(j, c, g):
            for module in attention_cls.key_value_modules:
                init(j, module, range(j, j + g))
    # A token shift starts at zero: the student is then the unshifted one (the least-squares start fits it).
    for j in shift_layers(config):
        for kind in ("k", "v"):
            own = new[f"model.layers.{j}.self_attn.{kind}_proj_swiftkv.weight"]
            new[f"model.layers.{j}.self_attn.{kind}_shift_swiftkv.weight"] = own.new_zeros(
                own.shape[0], config.key_value_shift_tokens * own.shape[1])
    return new


def swiftkv_config(
    base: PretrainedConfig, num_key_value_layers: int | None = None, key_value_group_size: int = 1,
    shift: TokenShift = NO_SHIFT,
) -> PretrainedConfig:
    """The SwiftKV config (student on) of a base model's config; the cutoff defaults to 50% SwiftKV;
    ``shift``: the token shift (off by default)."""
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
    config = config_cls(**fields, swiftkv=True, num_key_value_layers=c, key_value_group_size=key_value_group_size,
                        **shift.config_fields())
    config.architectures = [model_cls.__name__]
    return config


def convert_model(
    base: PreTrainedModel, num_key_value_layers: int | None = None, key_value_group_size: int = 1,
    shift: TokenShift = NO_SHIFT,
) -> PreTrainedModel:
    """A SwiftKV model (student on) holding ``base``'s weights plus the initialised SwiftKV weights.

    The base weights are shared with ``base``, not copied: one copy of the model sits in memory.
    """
    config = swiftkv_config(base.config, num_key_value_layers, key_value_group_size, shift)
    _, model_cls = FAMILIES[base.config.model_type]
    state = base.state_dict()
    state.update(swiftkv_initial_weights(state, config))
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
    base: str | Path,
    out: str | Path,
    num_key_value_layers: int | None = None,
    key_value_group_size: int = 1,
    cutoff: float | None = None,
    overwrite: bool = False,
    shift: TokenShift = NO_SHIFT,
) -> Path:
    """Write a SwiftKV checkpoint (safetensors, config, tokenizer, chat template) for ``base`` to ``out``.

    ``base`` is a local folder or hub id: ``swiftkv.model_source.resolve_model`` turns any model
    reference into one (and builds ``bundled-swiftkv`` with this function).

    ``cutoff`` (a fraction of the layers) is an alternative to ``num_key_value_layers``.
    The folder appears whole or not at all: it is written beside ``out`` and renamed at the end.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"output folder {out} exists and is not empty (pass overwrite=True / --overwrite)")
    if cutoff is not None and num_key_value_layers is not None:
        raise ValueError("give either a cutoff fraction or num_key_value_layers, not both")
    path = str(base)
    base_config = _base_config(path)
    if cutoff is not None:
        num_key_value_layers = cutoff_from_fraction(base_config.num_hidden_layers, cutoff)
    config = swiftkv_config(base_config, num_key_value_layers, key_value_group_size, shift)
    log.info("converting %s (%d layers) to SwiftKV at c=%d, g=%d", base, config.num_hidden_layers,
             config.num_key_value_layers, key_value_group_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        if has_safetensors(path):  # shard by shard: the base is never loaded whole
            new = swiftkv_initial_weights(ShardedTensors(path), config)
            write_checkpoint(path, new, config, tmp)
        else:
            swift = convert_model(load_base_model(path), config.num_key_value_layers, key_value_group_size, shift)
            swift.save_pretrained(tmp)
            AutoTokenizer.from_pretrained(path).save_pretrained(tmp)
        make_readable(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s", out)
    return out
