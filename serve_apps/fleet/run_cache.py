"""Each fleet run's figures kept on disk, keyed on what made them: the run's config and the source
of the code that computes them (the simulator, the replica model, Serve's control code as we drive
it, our policy and router, the profile and trace code) and the installed Ray's version. A change to
any of these makes a new key, so a stale run is computed again, never read back."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import fsspec
import ray

_SERVE_APPS = Path(__file__).resolve().parents[1]
SOURCES = tuple(_SERVE_APPS / name for name in (
    "fleet/simulator.py", "fleet/replica.py", "fleet/serve_control.py", "fleet/results.py", "fleet/profile.py",
    "fleet/config.py", "fleet/trace.py", "fleet/trace_files.py", "fleet/synthetic.py",
    "policy.py", "router.py", "load.py", "hints.py", "app.py", "config.py",
))
"""The code a run's figures depend on (the report's own layout does not change them)."""


def code_hash(sources: tuple[Path, ...]) -> str:
    digest = hashlib.sha256(ray.__version__.encode())
    for path in sources:
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


LOADED_CODE = code_hash(SOURCES)
"""The sources as this process loaded them (read at import: files edited while a report runs must not
label figures that the code in memory computed)."""


def run_key(config: dict[str, Any], code: str = LOADED_CODE) -> str:
    """A key for a run: its config (JSON-able) and the hash of the code that computes it."""
    payload = json.dumps({"config": config, "code": code}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class RunCache:
    """Figures under ``root`` (a folder or fsspec URI), one JSON file per run."""

    def __init__(self, root: str) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(root)

    def path(self, label: str, key: str) -> str:
        return f"{self.root}/{label.replace('/', '_').replace(' ', '_')}-{key}.json"

    def get(self, label: str, key: str) -> dict[str, Any] | None:
        path = self.path(label, key)
        if not self.fs.exists(path):
            return None
        with self.fs.open(path, "r") as f:
            return json.load(f)

    def put(self, label: str, key: str, figures: dict[str, Any]) -> dict[str, Any]:
        """Store ``figures``; return them as a later :meth:`get` reads them back."""
        text = json.dumps(figures, default=str)
        self.fs.makedirs(self.root, exist_ok=True)
        self.fs.pipe(self.path(label, key), text.encode())
        return json.loads(text)
