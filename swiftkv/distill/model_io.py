"""How the student is loaded and how the distilled one is written.

``load_student`` returns a SwiftKV model with the SPEC initialisation (or a SwiftKV checkpoint as it
is, built already sharded under ZeRO-3); ``convert_once`` writes a base model's SwiftKV conversion
to shared storage once, so that ZeRO-3 workers load that instead; ``write_swiftkv_part`` writes
what a distillation checkpoint changes (the SwiftKV tensors, the config, a pointer to the starting
model) and ``merge_swiftkv_part`` turns that into the full SPEC checkpoint, loadable by
``AutoModelForCausalLM`` after ``import swiftkv.modeling`` and by vLLM.
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
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

import swiftkv.modeling  # noqa: F401  (registers the SwiftKV Auto classes)
from swiftkv.checkpoint_files import write_checkpoint
from swiftkv.config import NO_SHIFT, TokenShift, shift_layers
from swiftkv.convert import convert_checkpoint, convert_model, load_base_model, swiftkv_config
from swiftkv.model_source import resolve_model

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
    shift: TokenShift = NO_SHIFT,
):
    """The SwiftKV model to distil: converted from a base checkpoint, or a SwiftKV checkpoint as it is
    (whose cutoff, group size and token shift must then agree with the config's, when given).

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
        have_shift = TokenShift(tuple(shift_layers(config)), getattr(config, "key_value_shift_tokens", 0))
        if shift.layers and shift != have_shift:
            raise ValueError(f"{path} is a SwiftKV checkpoint with the token shift {have_shift}, but the config "
                             f"asks for {shift}")
        with zero3_partitioned_init(deepspeed_config) if zero3 else nullcontext():
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if zero3:
        log.warning(
            "%s is a base checkpoint: every worker converts the whole model before ZeRO-3 shards it "
            "(the distillation job avoids this: it loads a conversion made once by convert_once)", path
        )
    return convert_model(load_base_model(path, dtype=dtype), num_key_value_layers, key_value_group_size, shift)


def check_layout(path: str, num_key_value_layers: int | None, key_value_group_size: int, shift: TokenShift) -> None:
    """Raise ``ValueError`` naming the field if the SwiftKV layout asked for does not fit the base
    checkpoint ``path`` (a cutoff out of range, a token-shift layer that computes no K/V...): read
    from its config alone, before any worker starts. A SwiftKV checkpoint is checked by ``load_student``."""
    config = AutoConfig.from_pretrained(path)
    if not config.model_type.endswith("_swiftkv"):
        swiftkv_config(config, num_key_value_layers, key_value_group_size, shift)


def conversion_memory_bytes(path: str, num_key_value_layers: int | None = None, key_value_group_size: int = 1) -> int:
    """Host memory a ``convert_once`` of the checkpoint ``path`` takes, with a 2 GiB margin: the new
    SwiftKV tensors (float32 at most) and the base tensors they are made from, one layer's at a time.
    A safetensors base is never loaded whole; any other format is (its weights' size on disk twice)."""
    from swiftkv.analysis.flops import swiftkv_param_count
    from swiftkv.checkpoint_files import has_safetensors
    from swiftkv.config import default_cutoff

    margin = 2 * 2**30
    if not has_safetensors(path):
        return margin + 2 * sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    config = AutoConfig.from_pretrained(path)
    c = num_key_value_layers or default_cutoff(config.num_hidden_layers)
    trainable, _ = swiftkv_param_count(config, c, key_value_group_size)
    return margin + 2 * 4 * trainable


def is_swiftkv_checkpoint(path: str) -> bool:
    return AutoConfig.from_pretrained(path).model_type.endswith("_swiftkv")


def _starting_folder(parent: str, name: str, key: bytes) -> tuple[str, bool]:
    """``(parent/<name>-<hash of key>, whether a finished one is there)``."""
    target = f"{parent.rstrip('/')}/{name}-{hashlib.sha1(key).hexdigest()[:12]}"
    fs, root = fsspec.core.url_to_fs(target)
    return target, fs.exists(f"{root}/config.json")


def _upload(local: Path, target: str) -> None:
    """Copy a checkpoint folder to ``target`` (a folder or fsspec URI), ``config.json`` last, so that a
    copy cut short is never taken for a finished one."""
    fs, root = fsspec.core.url_to_fs(target)
    fs.makedirs(root, exist_ok=True)
    for file in sorted(local.iterdir(), key=lambda f: f.name == "config.json"):
        fs.put_file(str(file), f"{root}/{file.name}")


def _layout_key(base: str, num_key_value_layers: int | None, key_value_group_size: int, shift: TokenShift,
                *extra: str) -> bytes:
    """What names a conversion of ``base``: the layout asked for (the token shift only when there is
    one, so conversions made before it existed keep their folders)."""
    shifted = [shift.config_fields()] if shift.layers else []
    return json.dumps([base, num_key_value_layers, key_value_group_size, *extra, *shifted]).encode()


def convert_once(base: str, parent: str, num_key_value_layers: int | None, key_value_group_size: int,
                 shift: TokenShift = NO_SHIFT) -> str:
    """Write the SwiftKV conversion of the model reference ``base`` under ``parent`` (a folder or an
    fsspec URI such as ``s3://``) and return where: ``student-init-<hash of the arguments>``, so a
    rerun with the same arguments finds and keeps it, and other arguments never meet a stale one."""
    target, done = _starting_folder(parent, "student-init",
                                    _layout_key(base, num_key_value_layers, key_value_group_size, shift))
    if done:
        log.info("reusing the SwiftKV conversion in %s", target)
        return target
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model"
        convert_checkpoint(resolve_model(base), local, num_key_value_layers, key_value_group_size, shift=shift)
        log.info("uploading the SwiftKV conversion of %s to %s", base, target)
        _upload(local, target)
    return target


INIT_FIT = "init_fit.json"


def least_squares_once(base: str, parent: str, num_key_value_layers: int | None, key_value_group_size: int,
                       rows: list[dict[str, Any]], dtype: torch.dtype, shift: TokenShift = NO_SHIFT) -> str:
    """Write the SwiftKV conversion of ``base`` with its key/value projections fitted by least squares
    on the calibration ``rows`` (``swiftkv.least_squares_init``) under ``parent``, with the fit's R²
    in ``init_fit.json``, and return where: ``student-init-ls-<hash of the arguments and rows>``
    (reused by a rerun, as ``convert_once``)."""
    from swiftkv.checkpoint_files import has_safetensors
    from swiftkv.least_squares_init import fit_swiftkv_kv

    key = _layout_key(base, num_key_value_layers, key_value_group_size, shift, str(dtype))
    key += b"".join(row["input_ids"].tobytes() + row["position_ids"].tobytes() for row in rows)
    target, done = _starting_folder(parent, "student-init-ls", key)
    if done:
        log.info("reusing the least-squares start in %s", target)
        return target
    path = resolve_model(base)
    model = convert_model(load_base_model(path, dtype=dtype), num_key_value_layers, key_value_group_size, shift)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fit = fit_swiftkv_kv(model.to(device), ({k: torch.tensor(row[k], device=device)[None] for k in
                                             ("input_ids", "position_ids")} for row in rows))
    model.load_state_dict(fit.tensors, strict=False)
    model.swiftkv(True)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / "model"
        if has_safetensors(path):
            write_checkpoint(path, dict(model.swiftkv_parameters()), model.config, local)
        else:
            model.save_pretrained(local)
            AutoTokenizer.from_pretrained(path).save_pretrained(local)
        report = {"r2": fit.r2, "r2_before": fit.copy_r2, "fit_tokens": fit.fit_tokens,
                  "heldout_tokens": fit.heldout_tokens, **fit.summary()}
        (local / INIT_FIT).write_text(json.dumps(report, indent=1) + "\n")
        log.info("uploading the least-squares start of %s to %s", base, target)
        _upload(local, target)
    return target


PART_TENSORS = "swiftkv.safetensors"
PART_START = "start.json"


def write_swiftkv_part(config: PretrainedConfig, tensors: dict[str, torch.Tensor], start: str, out: Path) -> None:
    """``out``: the SwiftKV tensors, the student's ``config.json`` and ``start.json`` naming the model
    reference (folder, ``s3://`` URI, hub id...) whose other weights they complete."""
    out.mkdir(parents=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, out / PART_TENSORS, metadata={"format": "pt"})
    config.save_pretrained(out)
    (out / PART_START).write_text(json.dumps({"model": start}) + "\n")


def merge_swiftkv_part(part: str | Path, out: str | Path) -> Path:
    """The full SPEC checkpoint of a distillation checkpoint's ``swiftkv/`` folder (or the checkpoint
    folder holding it): the starting model's weights with the trained SwiftKV tensors."""
    part = Path(part)
    if not (part / PART_START).is_file() and (part / "swiftkv" / PART_START).is_file():
        part = part / "swiftkv"
    if not (part / PART_START).is_file():
        raise FileNotFoundError(f"{part} is not a distillation checkpoint's swiftkv/ folder (no {PART_START})")
    start = json.loads((part / PART_START).read_text())["model"]
    return write_checkpoint(resolve_model(start), load_file(part / PART_TENSORS), AutoConfig.from_pretrained(part), out)
