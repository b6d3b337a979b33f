"""Where jobs put what they measured: files written to a folder or any fsspec URI, plots as PNG bytes."""

from __future__ import annotations

import io
from typing import Any

import fsspec


def write_files(out: str, files: dict[str, bytes]) -> None:
    """Write ``files`` (name -> content) under ``out``, a local folder or a URI such as ``s3://...``."""
    fs, root = fsspec.core.url_to_fs(out)
    fs.makedirs(root, exist_ok=True)
    fs.pipe({f"{root}/{name}": content for name, content in files.items()})


def figure_png(fig: Any, dpi: int = 120) -> bytes:
    """A matplotlib figure as PNG bytes (then closed, so long jobs do not accumulate figures)."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()
