"""What the tests mean by "readable by others": every file has the read bits the umask allows, every
folder the read and search bits (0644 files and 0755 folders under the usual 022)."""

from __future__ import annotations

import stat
from pathlib import Path

from swiftkv.file_modes import umask


def unreadable(root: str | Path) -> list[str]:
    """``root`` and the paths under it that others may not read, with their modes."""
    allowed = ~umask()
    root = Path(root)
    found = []
    for item in [root, *root.rglob("*")]:
        want = (0o555 if item.is_dir() else 0o444) & allowed
        mode = stat.S_IMODE(item.stat().st_mode)
        if mode & want != want:
            found.append(f"{item} {oct(mode)}")
    return found
