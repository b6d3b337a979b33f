"""Where the model comes from and how the distilled one is written.

``resolve_model`` turns the config's ``model`` into something ``from_pretrained`` can open on this
node (``bundled`` and ``s3://`` folders become local folders); ``load_student`` returns a SwiftKV
model with the SPEC initialisation (or a SwiftKV checkpoint as it is); ``write_hf_checkpoint``
writes the SPEC checkpoint layout, loadable by ``AutoModelForCausalLM`` after ``import swiftkv``.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import fsspec
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

import swiftkv  # noqa: F401  (registers the SwiftKV Auto classes)
from swiftkv.bundled import ensure_bundled_model
from swiftkv.convert import convert_model, load_base_model


def _download(uri: str) -> Path:
    """Copy a remote checkpoint folder once per node into the local cache (atomically)."""
    local = Path(tempfile.gettempdir()) / "swiftkv-models" / hashlib.sha1(uri.encode()).hexdigest()[:16]
    if (local / "config.json").is_file():
        return local
    fs, path = fsspec.core.url_to_fs(uri)
    if not fs.exists(f"{path.rstrip('/')}/config.json"):
        raise FileNotFoundError(f"model {uri!r} has no config.json: not a Hugging Face checkpoint folder")
    local.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=local.parent))
    fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
    try:
        tmp.rename(local)
    except OSError:  # another process on this node finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return local


def resolve_model(ref: str) -> str:
    """A local folder or hub id for ``ref`` (``bundled``, a folder, a hub id or a remote folder URI)."""
    if ref == "bundled":
        return str(ensure_bundled_model())
    if "://" in ref:
        return str(_download(ref))
    return ref


def load_student(path: str, num_key_value_layers: int | None, key_value_group_size: int, dtype: torch.dtype):
    """The SwiftKV model to distil: converted from a base checkpoint, or a SwiftKV checkpoint as it is
    (whose cutoff and group size must then agree with the config's, when given)."""
    config = AutoConfig.from_pretrained(path)
    if config.model_type.endswith("_swiftkv"):
        want = (num_key_value_layers or config.num_key_value_layers, key_value_group_size)
        have = (config.num_key_value_layers, config.key_value_group_size)
        if want != have:
            raise ValueError(
                f"{path} is a SwiftKV checkpoint with num_key_value_layers={have[0]}, key_value_group_size="
                f"{have[1]}, but the config asks for {want[0]}, {want[1]}"
            )
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return convert_model(load_base_model(path, dtype=dtype), num_key_value_layers, key_value_group_size)


def write_hf_checkpoint(model: PreTrainedModel, state_dict: dict[str, torch.Tensor], tokenizer, out: Path) -> None:
    """The student in the SPEC layout (``swiftkv: true``) with its tokenizer and chat template."""
    model.swiftkv(True)
    model.save_pretrained(out, state_dict=state_dict)
    tokenizer.save_pretrained(out)
