"""The `swiftkv` command as a user runs it: the installed entry point, its help and `generate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from swiftkv.cli import VERB_MODULES
from tests.tiny import save_tiny_base

SWIFTKV = str(Path(sys.executable).parent / "swiftkv")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SWIFTKV, *args], capture_output=True, text=True, timeout=300)


def test_help_lists_every_verb():
    out = run("--help")
    assert out.returncode == 0
    for module in VERB_MODULES:
        assert module.rsplit(".", 1)[1] in out.stdout


def test_convert_then_generate_as_student_and_teacher(tmp_path):
    save_tiny_base(tmp_path / "base", "llama")
    assert run("convert", str(tmp_path / "base"), str(tmp_path / "swift")).returncode == 0
    for extra in ([], ["--teacher"]):
        out = run("generate", str(tmp_path / "swift"), "w1 w2 w3", "w4", "--max-new-tokens", "5", *extra)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("### ") == 2 and "(2 prompts, " in out.stdout


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    out = run("convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert out.returncode == 2
    assert "swiftkv convert: error:" in out.stderr and "Traceback" not in out.stderr
