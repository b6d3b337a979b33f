"""Model references as every verb and job reads them (``swiftkv.model_source``): a folder,
``bundled``, an ``s3://`` folder on a real S3 server (moto's, on 127.0.0.1) and hub ids, with the
errors a mistyped one gets; and the distillation job's one-time conversion to S3."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest

from swiftkv.bundled import default_model_dir
from swiftkv.checkpoint_files import ShardedTensors, is_swiftkv_tensor
from swiftkv.cli import main as cli
from swiftkv.model_source import resolve_model
from tests.s3_server import moto_s3_server, s3_env
from tests.tiny import save_tiny_base


@pytest.fixture(scope="module")
def s3_server():
    """One moto server for the module."""
    with moto_s3_server() as endpoint, s3_env(endpoint):
        fs = fsspec.filesystem("s3")
        fs.mkdir("models")
        yield fs


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """The S3 filesystem; remote models are cached under ``tmp_path``."""
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path / "cache"))
    return s3_server


def test_convert_from_an_s3_folder_equals_the_local_conversion(s3, tmp_path):
    save_tiny_base(tmp_path / "base", "llama")
    s3.put(f"{tmp_path / 'base'}/", "models/convert/", recursive=True)
    assert cli(["convert", "s3://models/convert", str(tmp_path / "from-s3")]) == 0
    assert cli(["convert", str(tmp_path / "base"), str(tmp_path / "from-disk")]) == 0
    remote, local = (ShardedTensors(tmp_path / d) for d in ("from-s3", "from-disk"))
    assert any(is_swiftkv_tensor(k) for k in local)
    assert remote.keys() == local.keys() and all((remote[k] == local[k]).all() for k in local)
    assert (tmp_path / "from-s3" / "tokenizer.json").is_file()


def test_a_remote_folder_is_copied_once_per_node(s3, tmp_path):
    save_tiny_base(tmp_path / "base", "llama")
    s3.put(f"{tmp_path / 'base'}/", "models/llama/", recursive=True)
    copy = resolve_model("s3://models/llama")
    assert Path(copy).is_relative_to(tmp_path / "cache") and (Path(copy) / "config.json").is_file()
    s3.rm("models/llama/model.safetensors")  # a second copy would now lack the weights
    assert resolve_model("s3://models/llama") == copy  # served from the node's cache
    assert (Path(copy) / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="'s3://models/nothing' has no config.json"):
        resolve_model("s3://models/nothing")


def test_folders_bundled_and_bad_references(tmp_path):
    assert resolve_model(tmp_path) == str(tmp_path)
    assert resolve_model("bundled") == str(default_model_dir())
    with pytest.raises(FileNotFoundError, match="model folder ./no-such-folder does not exist"):
        resolve_model("./no-such-folder")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="is a file; a model is a checkpoint folder"):
        resolve_model(tmp_path / "config.json")
    # HF_HUB_OFFLINE=1 in the suite: an id that is in no local cache cannot be loaded here.
    with pytest.raises(FileNotFoundError, match="'no-such-org/no-such-model' is not a local folder, 'bundled'"):
        resolve_model("no-such-org/no-such-model")


def test_convert_once_to_s3_is_reused_and_kept_apart_per_arguments(s3, tmp_path):
    """The ZeRO-3 starting point of the distillation job: converted once to S3 and loaded from there
    by the workers (``resolve_model``); a rerun keeps it; another cutoff or base model gets its own."""
    from transformers import AutoConfig

    from swiftkv.distill.model_io import convert_once

    for name in ("base", "other"):
        save_tiny_base(tmp_path / name, "llama", num_hidden_layers=4, seed=len(name))
    first = convert_once(str(tmp_path / "base"), "s3://models/run", None, 1)
    assert first.startswith("s3://models/run/student-init-")
    assert AutoConfig.from_pretrained(resolve_model(first)).num_key_value_layers == 2  # half of 4
    s3.put_file(str(tmp_path / "base" / "config.json"), first.removeprefix("s3://") + "/marker")
    assert convert_once(str(tmp_path / "base"), "s3://models/run", None, 1) == first
    assert s3.exists(first.removeprefix("s3://") + "/marker")  # reused, not rewritten
    other_cutoff = convert_once(str(tmp_path / "base"), "s3://models/run", 3, 1)
    other_base = convert_once(str(tmp_path / "other"), "s3://models/run", None, 1)
    assert len({first, other_cutoff, other_base}) == 3
    assert json.loads(s3.cat_file(other_cutoff.removeprefix("s3://") + "/config.json"))["num_key_value_layers"] == 3


def test_a_model_uploaded_again_is_copied_again(s3, tmp_path):
    for name, layers in (("v1", 4), ("v2", 6)):
        save_tiny_base(tmp_path / name, "llama", num_hidden_layers=layers)
    s3.put(f"{tmp_path / 'v1'}/", "models/again/", recursive=True)
    first = resolve_model("s3://models/again")
    s3.put(f"{tmp_path / 'v2'}/", "models/again/", recursive=True)
    second = resolve_model("s3://models/again")
    assert second != first and json.loads((Path(second) / "config.json").read_text())["num_hidden_layers"] == 6
