"""What the project writes is read by others: a serving container running as another user
(KubeRay's images run as uid 1000), a shared volume, a colleague. A plain ``open`` or ``mkdir``
gives the modes the umask allows (0644 files, 0755 folders under the usual 022), but two writers we
use give private ones that a rename into place keeps: ``tempfile`` (0700 folders, 0600 files) and
safetensors (0600 files, ``save_pretrained``'s weights included). Writers call :func:`make_readable`
on what they made before it becomes final."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def umask() -> int:
    """The process's umask."""
    # It can only be read by setting it: a strict one for that instant (a file another thread
    # creates meanwhile is only ever more private), then the old one back.
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def make_readable(path: str | Path) -> None:
    """Give ``path``, and everything under it if it is a folder, the read bits (and, for folders, the
    search bits) the umask allows, as a plain ``open`` or ``mkdir`` would. Nothing is taken away and
    no write bit is added: under a 077 umask everything stays private."""
    allowed = ~umask()
    root = Path(path)
    for item in [root, *root.rglob("*")] if root.is_dir() else [root]:
        if item.is_symlink():
            continue
        bits = 0o555 if item.is_dir() else 0o444
        item.chmod(stat.S_IMODE(item.stat().st_mode) | (bits & allowed))
