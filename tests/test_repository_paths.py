"""No tracked file names a path outside the repository: a user who clones it must be able to run
every command and config in it (the traces, for one, are shipped in ``serve_apps/fleet/traces/``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Machine roots and the shared folder beside a checkout, spelled in parts so that this file names
# none of them itself.
ROOTS = ["work", "root", "home", "farm"]
OUTSIDE = re.compile(r"(?:^|[^.\w])/(?:" + "|".join(ROOTS) + r")/|(?:\.\./)+shared\b")


def outside_paths(text: str) -> list[str]:
    return [m.group(0).lstrip("\"'( ") for m in OUTSIDE.finditer(text)]


def test_the_pattern_catches_outside_paths():
    shared = "/" + "/".join([ROOTS[0], "shared", "traces", "x.jsonl"])
    assert outside_paths(f"trace: {shared}") == [f"/{ROOTS[0]}/"]
    assert outside_paths(f"open('/{ROOTS[2]}/me/x')") == [f"/{ROOTS[2]}/"]
    up = "../"
    assert outside_paths(f"read_trace('{up}shared/traces/x.jsonl')") == [f"{up}shared"]
    assert outside_paths(f"see {up}{up}shared/reference") == [f"{up}{up}shared"]
    assert outside_paths("serve_apps/fleet/traces/x.jsonl, docs/../README.md, a shared_host slowdown, "
                         f"artifacts/{ROOTS[0]}/x, http://example.com/{ROOTS[1]}/y") == []


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_no_tracked_file_names_a_path_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    found = []
    for name in files.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        found += [f"{name}: {hit}" for hit in outside_paths(text)]
    assert not found, "tracked files name paths outside the repository:\n" + "\n".join(found)
