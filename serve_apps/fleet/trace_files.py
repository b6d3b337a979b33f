"""Trace files: the Mooncake JSON-lines format and the Azure LLM inference CSV format, read into a
:class:`~serve_apps.fleet.trace.Trace`; bad input is one ``ValueError`` naming the file, the line and
the field.

- Mooncake: one JSON object a line, ``timestamp`` (arrival, ms from the start), ``input_length`` and
  ``output_length`` (tokens), ``hash_ids`` (prefix block hashes, 512 tokens a block).
- Azure (2023): a CSV with a header, ``TIMESTAMP`` (arrival, wall clock), ``ContextTokens``,
  ``GeneratedTokens``; arrivals count from the first row, and there are no prefix blocks.

``serve_apps/fleet/traces/README.md`` describes the three traces shipped in these formats. Arrivals
must not go backwards: a trace out of order is a broken file, not something to sort silently.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from serve_apps.fleet.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceRequest

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
"""The Azure trace's columns (any others are ignored)."""


def _count(value: object, key: str, where: str, least: int = 0) -> int:
    if isinstance(value, str):  # a CSV cell
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{where}: {key!r} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < least:
        raise ValueError(f"{where}: {key!r} must be an integer of at least {least}, got {value!r}")
    return int(value)


def parse_line(line: str, where: str) -> TraceRequest:
    """One Mooncake line; a ``ValueError`` naming ``where`` (file:line) and the field otherwise."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: not a JSON object")
    for key in ("timestamp", "input_length", "output_length"):
        if key not in row:
            raise ValueError(f"{where}: missing {key!r}")
    arrival_ms = row["timestamp"]
    if isinstance(arrival_ms, bool) or not isinstance(arrival_ms, (int, float)) or not math.isfinite(arrival_ms) \
            or arrival_ms < 0:
        raise ValueError(f"{where}: 'timestamp' must be a non-negative number of milliseconds, got {arrival_ms!r}")
    blocks = row.get("hash_ids", [])
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise ValueError(f"{where}: 'hash_ids' must be a list of integers")
    return TraceRequest(arrival_ms / 1000.0, _count(row["input_length"], "input_length", where, 1),
                        _count(row["output_length"], "output_length", where), tuple(blocks))


def _mooncake(path: Path) -> Iterator[tuple[str, str, TraceRequest]]:
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield f"{path}:{number}", "timestamp", parse_line(line, f"{path}:{number}")


def _azure(path: Path) -> Iterator[tuple[str, str, TraceRequest]]:
    with path.open(newline="") as f:
        rows = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (rows.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}:1: missing column {missing[0]!r} (an Azure trace has {', '.join(AZURE_COLUMNS)})")
        start = None
        for row in rows:
            where = f"{path}:{rows.line_num}"
            try:
                at = datetime.fromisoformat(row["TIMESTAMP"] or "")
            except ValueError:
                raise ValueError(f"{where}: 'TIMESTAMP' must be a date and time, got {row['TIMESTAMP']!r}") from None
            start = at if start is None else start
            yield where, "TIMESTAMP", TraceRequest((at - start).total_seconds(),
                                                   _count(row["ContextTokens"], "ContextTokens", where, 1),
                                                   _count(row["GeneratedTokens"], "GeneratedTokens", where))


def read_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a trace file in either format, told apart by its first line (a JSON object: Mooncake;
    a header naming ``TIMESTAMP``: Azure)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open() as f:
        first = next((line.strip() for line in f if line.strip()), "")
    if first.startswith("{"):
        rows = _mooncake(path)
    elif "TIMESTAMP" in first.split(","):
        rows = _azure(path)
    else:
        raise ValueError(f"{path}:1: neither a Mooncake trace (a JSON object a line) nor an Azure trace "
                         f"(a CSV header {','.join(AZURE_COLUMNS)})")
    requests: list[TraceRequest] = []
    for where, field, request in rows:
        if requests and request.arrival_s < requests[-1].arrival_s:
            raise ValueError(f"{where}: {field!r} goes backwards ({request.arrival_s:g} s after the first "
                             f"arrival, the line before {requests[-1].arrival_s:g} s)")
        requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no requests in the trace")
    return Trace(tuple(requests), block_tokens)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` in the Mooncake format (what :func:`read_trace` reads back)."""
    with Path(path).open("w") as out:
        for r in trace.requests:
            out.write(json.dumps({"timestamp": round(r.arrival_s * 1000, 3), "input_length": r.input_tokens,
                                  "output_length": r.output_tokens, "hash_ids": list(r.blocks)}) + "\n")
