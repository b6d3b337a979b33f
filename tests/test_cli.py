"""The `swiftkv` command as a user runs it: the installed entry point, its help and `generate`."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from swiftkv.cli import VERB_GROUP, VERB_MODULES
from tests.tiny import save_tiny_base

SWIFTKV = str(Path(sys.executable).parent / "swiftkv")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SWIFTKV, *args], capture_output=True, text=True, timeout=300)


def test_help_lists_every_verb_without_importing_the_heavy_stack():
    out = run("--help")
    assert out.returncode == 0
    added = [entry.name for entry in entry_points(group=VERB_GROUP)]
    # The Serve app's verbs reach the command through the package's entry points.
    assert sorted(added) == ["calibrate", "fleet", "serve"], "stale install: rerun scripts/setup.sh (pip install -e .)"
    for verb in [module.rsplit(".", 1)[1] for module in VERB_MODULES] + added:
        assert f"\n    {verb} " in out.stdout
    # What makes --help and argument errors answer at once: building every verb's parser imports
    # none of torch, transformers, Ray or vLLM (each takes seconds to import).
    probe = ("import sys; from swiftkv.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'transformers', 'ray', 'vllm', 'lm_eval') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_convert_then_generate_as_student_and_teacher(tmp_path):
    save_tiny_base(tmp_path / "base", "llama")
    assert run("convert", str(tmp_path / "base"), str(tmp_path / "swift")).returncode == 0
    for extra in ([], ["--teacher"]):
        out = run("generate", str(tmp_path / "swift"), "w1 w2 w3", "w4", "--max-new-tokens", "5", *extra)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("### ") == 2 and "(2 prompts, " in out.stdout


def test_bad_input_is_one_line_not_a_traceback_unless_debug(tmp_path):
    out = run("convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert out.returncode == 2
    assert "swiftkv convert: error:" in out.stderr and "Traceback" not in out.stderr
    debug = run("--debug", "convert", str(tmp_path / "nope"), str(tmp_path / "out"))
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


def test_every_entry_point_takes_the_same_default_cutoff(tmp_path):
    """Odd layer counts: ``swiftkv convert`` without a cutoff and a config without
    ``num_key_value_layers`` give the same c (50% SwiftKV, ceil(L / 2))."""
    from transformers import AutoConfig

    from tests.tiny import tiny_config

    save_tiny_base(tmp_path / "base", "llama", num_hidden_layers=5)
    assert run("convert", str(tmp_path / "base"), str(tmp_path / "swift")).returncode == 0
    converted = AutoConfig.from_pretrained(tmp_path / "swift").num_key_value_layers
    assert converted == tiny_config("llama", num_hidden_layers=5, num_key_value_layers=None).num_key_value_layers == 3
