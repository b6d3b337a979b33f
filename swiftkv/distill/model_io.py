"""How the student is loaded and how the distilled one is written.

``load_student`` returns a SwiftKV model with the SPEC initialisation (or a SwiftKV checkpoint as it
is, built already sharded under ZeRO-3); ``convert_once`` writes a base model's SwiftKV conversion
to shared storage once, so that ZeRO-3 workers load that instead; ``write_hf_checkpoint`` writes the
SPEC checkpoint layout, loadable by ``AutoModelForCausalLM`` after ``import swiftkv.modeling``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import fsspec
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import swiftkv.modeling  # noqa: F401  (registers the SwiftKV Auto classes)
from swiftkv.convert import convert_checkpoint, convert_model, load_base_model

log = logging.getLogger(__name__)


@contextmanager
def zero3_partitioned_init(deepspeed_config: dict[str, Any]) -> Iterator[None]:
    """While open, ``from_pretrained`` builds models under ``deepspeed.zero.Init`` (transformers'
    DeepSpeed integration): each parameter is sharded across the ranks as it is created and the
    checkpoint's values are copied in one module at a time, so no worker builds a full copy of the
    model's parameters (each still reads the checkpoint files)."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_config = HfDeepSpeedConfig(deepspeed_config)  # transformers sees ZeRO-3 while this lives
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del hf_config


def load_student(
    path: str,
    num_key_value_layers: int | None,
    key_value_group_size: int,
    dtype: torch.dtype,
    deepspeed_config: dict[str, Any] | None = None,
):
    """The SwiftKV model to distil: converted from a base checkpoint, or a SwiftKV checkpoint as it is
    (whose cutoff and group size must then agree with the config's, when given).

    With a ZeRO-3 ``deepspeed_config`` a SwiftKV checkpoint is loaded already partitioned; a base
    checkpoint is converted whole on every worker first (``convert_once`` avoids that)."""
    config = AutoConfig.from_pretrained(path)
    zero3 = bool(deepspeed_config) and deepspeed_config["zero_optimization"]["stage"] == 3
    if config.model_type.endswith("_swiftkv"):
        want = (num_key_value_layers or config.num_key_value_layers, key_value_group_size)
        have = (config.num_key_value_layers, config.key_value_group_size)
        if want != have:
            raise ValueError(
                f"{path} is a SwiftKV checkpoint with num_key_value_layers={have[0]}, key_value_group_size="
                f"{have[1]}, but the config asks for {want[0]}, {want[1]}"
            )
        with zero3_partitioned_init(deepspeed_config) if zero3 else nullcontext():
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if zero3:
        log.warning(
            "%s is a base checkpoint: every worker converts the whole model before ZeRO-3 shards it "
            "(the distillation job avoids this: it loads a conversion made once by convert_once)", path
        )
    return convert_model(load_base_model(path, dtype=dtype), num_key_value_layers, key_value_group_size)


def is_swiftkv_checkpoint(path: str) -> bool:
    return AutoConfig.from_pretrained(path).model_type.endswith("_swiftkv")


def convert_once(base: str, parent: str, num_key_value_layers: int | None, key_value_group_size: int) -> str:
    """Write the SwiftKV conversion of the model reference ``base`` under ``parent`` (a folder or an
    fsspec URI such as ``s3://``) and return where: ``student-init-<hash of the arguments>``, so a
    rerun with the same arguments finds and keeps it, and other arguments never meet a stale one.
    ``config.json`` is written last, so a conversion cut short is never taken for a finished one."""
    args = json.dumps([base, num_key_value_layers, key_value_group_size])
    target = f"{parent.rstrip('/')}/student-init-{hashlib.sha1(args.encode()).hexdigest()[:12]}"
    fs, root = fsspec.core.url_to_fs(target)
    if fs.exists(f"{root}/config.json"):
        log.info("reusing the SwiftKV conversion in %s", target)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model"
        convert_checkpoint(base, local, num_key_value_layers, key_value_group_size)
        log.info("uploading the SwiftKV conversion of %s to %s", base, target)
        fs.makedirs(root, exist_ok=True)
        for file in sorted(local.iterdir(), key=lambda f: f.name == "config.json"):
            fs.put_file(str(file), f"{root}/{file.name}")
    return target


def write_hf_checkpoint(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], tokenizer, out: Path) -> None:
    """The student in the SPEC layout (``swiftkv: true``) with its tokenizer and chat template."""
    model.swiftkv(True)
    model.save_pretrained(out, state_dict=state_dict)
    tokenizer.save_pretrained(out)
