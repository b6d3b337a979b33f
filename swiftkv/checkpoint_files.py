"""SPEC checkpoints written shard by shard: a model's own safetensors shards, copied as they are,
plus the SwiftKV tensors as one more shard, tied together by the standard index file.

Converting a base model and finishing a distillation both come down to "these weights plus these
SwiftKV tensors", and neither needs the whole model in memory: a 70B base is 140 GB of shards that
are copied file by file, while only the tensors SwiftKV reads or adds are loaded. transformers and
vLLM read the result like any sharded checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PretrainedConfig

from swiftkv.file_modes import make_readable

INDEX = "model.safetensors.index.json"
SWIFTKV_SHARD = "model-swiftkv.safetensors"
SINGLE_FILE = "model.safetensors"  # loaders read this name alone, ignoring any index: renamed when copied
RENAMED_SINGLE_FILE = "model-base.safetensors"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_NOT_COPIED = {"config.json", INDEX}


def is_swiftkv_tensor(name: str) -> bool:
    return "_swiftkv" in name


def _shards(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob("*.safetensors"))


def has_safetensors(folder: str | Path) -> bool:
    return bool(_shards(Path(folder)))


class ShardedTensors(Mapping[str, torch.Tensor]):
    """The tensors of a checkpoint folder's safetensors shards by name, each read from its file
    only when asked for (a dict of the names that never loads the model)."""

    def __init__(self, folder: str | Path):
        self._file: dict[str, Path] = {}
        for shard in _shards(Path(folder)):
            with safe_open(shard, framework="pt") as f:
                self._file.update(dict.fromkeys(f.keys(), shard))
        if not self._file:
            raise FileNotFoundError(f"{folder} holds no safetensors weights")

    def __getitem__(self, name: str) -> torch.Tensor:
        with safe_open(self._file[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file)

    def __len__(self) -> int:
        return len(self._file)


def write_checkpoint(
    start: str | Path, swiftkv: Mapping[str, torch.Tensor], config: PretrainedConfig, out: str | Path
) -> Path:
    """Write ``out``: every weight of the checkpoint ``start`` except its SwiftKV tensors (shards
    copied as files; a shard that holds SwiftKV tensors is rewritten without them), ``swiftkv`` as
    the shard ``model-swiftkv.safetensors``, the index, ``config`` and ``start``'s other files
    (tokenizer, chat template, generation config)."""
    start, out = Path(start), Path(out)
    shards = _shards(start)
    if not shards:
        raise FileNotFoundError(f"{start} holds no safetensors weights (other formats: load it and save_pretrained)")
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        name = RENAMED_SINGLE_FILE if shard.name == SINGLE_FILE else shard.name
        with safe_open(shard, framework="pt") as f:
            names = list(f.keys())
            kept = [n for n in names if not is_swiftkv_tensor(n)]
            if len(kept) == len(names):
                shutil.copyfile(shard, out / name)
            elif kept:  # a SwiftKV checkpoint's own SwiftKV tensors give way to the new ones
                save_file({n: f.get_tensor(n) for n in kept}, out / name, metadata={"format": "pt"})
            for n in kept:
                weight_map[n] = name
                sliced = f.get_slice(n)
                total += _nbytes(sliced.get_shape(), sliced.get_dtype())
    tensors = {name: t.detach().contiguous().cpu() for name, t in swiftkv.items()}
    save_file(tensors, out / SWIFTKV_SHARD, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, SWIFTKV_SHARD))
    total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for file in start.iterdir():
        if file.is_file() and file.name not in _NOT_COPIED and not file.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(file, out / file.name)
    config.save_pretrained(out)
    make_readable(out)
    return out


_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "F8_E4M3": 1,
                "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _nbytes(shape: list[int], dtype: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count * _DTYPE_BYTES[dtype]
