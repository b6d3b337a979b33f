"""Everything the project writes is readable by others as the umask allows, as ``open`` and
``mkdir`` make it: conversions, the bundled model, remote models copied into the cache, the
benchmark mirror, reports (distillation checkpoints: ``test_distill_job.py``). The writers this
guards against are real: safetensors writes 0600 files (``save_pretrained``'s weights too), and
``tempfile``'s 0700 folders keep their mode when renamed into place."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from swiftkv.bundled import ensure_bundled_model
from swiftkv.convert import convert_checkpoint
from swiftkv.evaluation.offline_data import build_mirror
from swiftkv.model_source import resolve_model
from swiftkv.outputs import write_files
from tests.file_modes import unreadable
from tests.tiny import save_tiny_base


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def modes(root: Path) -> set[str]:
    return {oct(stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


def test_a_conversion_gets_the_modes_save_pretrained_would_under_the_umask(tmp_path, umask_022):
    save_tiny_base(tmp_path / "base", "llama")
    assert stat.S_IMODE((tmp_path / "base" / "model.safetensors").stat().st_mode) == 0o600  # safetensors' own
    out = convert_checkpoint(tmp_path / "base", tmp_path / "swiftkv", num_key_value_layers=2)
    assert unreadable(out) == []
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {oct(stat.S_IMODE(f.stat().st_mode)) for f in out.iterdir()} == {"0o644"}


def test_a_private_umask_keeps_a_conversion_private(tmp_path):
    save_tiny_base(tmp_path / "base", "llama")
    old = os.umask(0o077)
    try:
        out = convert_checkpoint(tmp_path / "base", tmp_path / "swiftkv", num_key_value_layers=2)
    finally:
        os.umask(old)
    assert modes(out) == {"0o700", "0o600"}


def test_caches_mirror_and_reports_are_readable(tmp_path, monkeypatch, umask_022):
    save_tiny_base(tmp_path / "base", "llama")
    (tmp_path / "base").chmod(0o700)  # a private source stays private; its copy follows the umask
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path / "cache"))
    copied = Path(resolve_model(f"file://{tmp_path / 'base'}"))
    assert copied.is_relative_to(tmp_path / "cache") and unreadable(copied) == []
    assert unreadable(ensure_bundled_model(tmp_path / "bundled")) == []
    assert unreadable(build_mirror(tmp_path / "mirror")) == []
    write_files(str(tmp_path / "report"), {"report.json": b"{}", "plot.png": b"png"})
    assert unreadable(tmp_path / "report") == []
