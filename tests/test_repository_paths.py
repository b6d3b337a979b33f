"""No tracked file names a path outside the repository: a user who clones it must be able to run
every command and config in it (the traces, for one, are shipped in ``serve_apps/fleet/traces/``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# This project's machines keep shared material in /work and worktrees beside it; ../shared is the
# same place seen from a checkout.
OUTSIDE = re.compile(r"/work/|(?:\.\./)+shared\b|/home/[a-z]")


def outside_paths(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def test_the_pattern_catches_outside_paths():
    assert outside_paths("trace: /work/shared/traces/x.jsonl") == ["/work/"]
    assert outside_paths("read_trace('../shared/traces/x.jsonl')") == ["../shared"]
    assert outside_paths("see ../../shared/reference") == ["../../shared"]
    assert outside_paths("serve_apps/fleet/traces/x.jsonl, docs/../README.md, a shared_host slowdown") == []


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_tracked_file_names_a_path_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    found = []
    for name in files.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file() or path == Path(__file__).resolve():  # this file spells the patterns
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        found += [f"{name}: {hit}" for hit in outside_paths(text)]
    assert not found, "tracked files name paths outside the repository:\n" + "\n".join(found)
