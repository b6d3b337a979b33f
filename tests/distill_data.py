"""Small chat files in the real public schemas (UltraChat-200k, OpenHermes-2.5, SlimOrca, chitchat)
for the distillation tests; none of those datasets is reachable from CI."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ULTRACHAT_ROW = {
    "prompt": "What is the capital of France?",
    "prompt_id": "0001",
    "messages": [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital of France."},
    ],
}
OPENHERMES_ROW = {
    "conversations": [
        {"from": "system", "value": "You are a helpful assistant.", "weight": None},
        {"from": "human", "value": "Name a prime number.", "weight": None},
        {"from": "gpt", "value": "Seven is a prime number.", "weight": None},
    ],
    "source": "airoboros2.2",
}
SLIMORCA_ROW = {
    "conversations": [
        {"from": "system", "value": "You are an AI assistant.", "weight": None},
        {"from": "human", "value": "Translate 'hello' to Spanish.", "weight": 0.0},
        {"from": "gpt", "value": "Hola.", "weight": 1.0},
    ]
}
CHITCHAT_ROW = {
    "messages": [
        [{"text": "Hello", "sender": "a"}, {"text": "How are you?", "sender": "a"}],
        [{"text": "Fine, thanks.", "sender": "b"}],
    ]
}

_WORDS = (
    "the model reads a long prompt and answers with care about rivers mountains cities music "
    "numbers stars trains gardens history bread coffee rain letters maps windows"
).split()


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)).capitalize() + "."


def ultrachat_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "prompt": (q := _sentence(rng, rng.randint(4, 12))),
            "prompt_id": f"{seed}-{i}",
            "messages": [
                {"role": "user", "content": q},
                {"role": "assistant", "content": _sentence(rng, rng.randint(6, 20))},
            ],
        }
        for i in range(n)
    ]


def sharegpt_rows(n: int, seed: int = 0) -> list[dict]:
    """OpenHermes / SlimOrca rows (same ``conversations`` schema)."""
    rng = random.Random(seed)
    return [
        {
            "conversations": [
                {"from": "system", "value": "You are a helpful assistant.", "weight": None},
                {"from": "human", "value": _sentence(rng, rng.randint(4, 12)), "weight": None},
                {"from": "gpt", "value": _sentence(rng, rng.randint(6, 20)), "weight": None},
            ]
        }
        for _ in range(n)
    ]


def write_parquet(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
