"""One frontier table and plot from several ``benchmarks.quality_frontier`` runs.

    python -m benchmarks.frontier_table --set 'runs=[artifacts/frontier, artifacts/frontier-c17]' \\
        --set out=artifacts/frontier-all

A frontier run on two cores measures one or two cutoffs at a time, each into its own ``out``. This
reads each run's ``frontier.json`` and writes the rows of all of them, ordered by prefill saved, as
``frontier.md``, ``frontier.json`` and ``frontier.png`` under ``out``. Nothing is re-measured: a model
in several runs keeps its first run's row, and the runs must have measured the same base with the same
evaluation sizes (else their rows do not share a scale, and this says which run differs).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

from pydantic import Field

from benchmarks.quality_frontier import TOKEN_SHIFT, row_label
from swiftkv.yaml_config import StrictConfig, job_main

log = logging.getLogger("benchmarks.frontier_table")
METHOD_ORDER = {"base": 0, "swiftkv": 1, TOKEN_SHIFT: 2, "rewired": 3, "drop layers": 4}


class FrontierTableConfig(StrictConfig):
    runs: list[str] = Field(min_length=1)
    """Output folders of ``benchmarks.quality_frontier`` runs, each holding its ``frontier.json``."""

    out: str = "artifacts/frontier-all"
    """Where the combined ``frontier.md``, ``frontier.json`` and ``frontier.png`` go."""


def _sizes(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What a run's figures are measured on: n per retrieval length, per recall and per task."""
    sizes: dict[str, Any] = {}
    for row in rows:
        sizes.update({f"retrieval {x}": cell["n"] for x, cell in row.get("retrieval", {}).items()})
        if row.get("recall"):
            sizes["recall"] = row["recall"]["n"]
        sizes.update({task: part["n"] for task, part in row["tasks"].items()})
    return sizes


def combine(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of every run (``{folder: rows}``), each model once, base first, then by prefill
    saved with each cutoff's SwiftKV, copy start and drop-layers rows together."""
    first, *_ = runs
    base, sizes = None, _sizes(runs[first])
    merged: dict[str, dict[str, Any]] = {}
    for folder, rows in runs.items():
        if _sizes(rows) != sizes:
            raise ValueError(f"{folder}: measured on other sizes than {first} ({_sizes(rows)} vs {sizes}); "
                             "its rows would not share the table's scale")
        run_base = next((r for r in rows if r["method"] == "base"), None)
        if run_base is None:
            raise ValueError(f"{folder}/frontier.json has no base row")
        if base is None:
            base = run_base
        elif run_base["tasks"] != base["tasks"]:
            raise ValueError(f"{folder}: its base scored otherwise than {first}'s on the tasks "
                             "(another base model or other documents)")
        for row in rows:
            merged.setdefault(row_label(row), row)
    return sorted(merged.values(), key=lambda r: (r["prefill_saving"], METHOD_ORDER[r["method"]]))


def read_runs(folders: list[str]) -> dict[str, list[dict[str, Any]]]:
    runs = {}
    for folder in folders:
        path = Path(folder) / "frontier.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no frontier here (run benchmarks.quality_frontier with out={folder})")
        runs[folder] = json.loads(path.read_text())["rows"]
    return runs


def run(cfg: FrontierTableConfig) -> dict[str, Any]:
    from benchmarks.quality_frontier import format_frontier, plot_frontier
    from swiftkv.outputs import write_files

    rows = combine(read_runs(cfg.runs))
    table = format_frontier(rows)
    log.info("%d rows from %d runs -> %s", len(rows), len(cfg.runs), cfg.out)
    write_files(cfg.out, {"frontier.json": json.dumps({"rows": rows, "runs": cfg.runs}, indent=1).encode(),
                          "frontier.md": (table + "\n").encode(), "frontier.png": plot_frontier(rows)})
    print(table)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m benchmarks.frontier_table", __doc__.split("\n\n")[0], FrontierTableConfig, run, argv,
                    what="frontier table config", config_help="YAML config (or give runs with --set)")


if __name__ == "__main__":
    sys.exit(main())
