"""What the router needs to know about a request before it reaches a replica: roughly how many prompt
tokens it carries and which prefix blocks it starts with.

The ingress reads the OpenAI body only as JSON (it never tokenizes: it may run on a node that has no
copy of the model), so the token count of a text prompt is an estimate (characters / 4, about right
for English BPE vocabularies) and prefix blocks are fixed-size runs of characters. A prompt given as
token ids is counted exactly and blocked by tokens. Both only rank replicas against each other: the
same request is added to every candidate's load, so the estimate's error mostly cancels.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

CHARS_PER_TOKEN = 4.0
"""Characters per token assumed for text prompts."""

DEFAULT_BLOCK_TOKENS = 64
"""Prefix block size in tokens (chained hashes of full blocks only, as vLLM's prefix cache keeps)."""

MAX_BLOCKS = 512
"""Prefix blocks hashed per request at most (32K tokens at 64 per block): bounds the ingress's work."""


@dataclass(frozen=True)
class PromptHint:
    """A request's routing facts: estimated prompt tokens and chained hashes of its prefix blocks."""

    prompt_tokens: float
    prefix_blocks: tuple[int, ...] = field(default=())
    block_tokens: int = DEFAULT_BLOCK_TOKENS


def _chain(pieces: list[bytes]) -> tuple[int, ...]:
    """Chained 64-bit hashes: block i's hash covers blocks 0..i, so equal hashes mean equal prefixes."""
    hashes, previous = [], b""
    for piece in pieces[:MAX_BLOCKS]:
        previous = hashlib.blake2b(previous + piece, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "little"))
    return tuple(hashes)


def _text_of_content(content: Any) -> str:
    """A chat message's text (plain string or OpenAI content parts; non-text parts count as nothing)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _hint_for_text(text: str, block_tokens: int) -> PromptHint:
    block_chars = int(block_tokens * CHARS_PER_TOKEN)
    data = text.encode("utf-8", "surrogatepass")  # JSON may carry lone surrogates; the engine refuses them
    pieces = [data[i : i + block_chars] for i in range(0, len(data) - block_chars + 1, block_chars)]
    return PromptHint(len(text) / CHARS_PER_TOKEN, _chain(pieces), block_tokens)


def _hint_for_ids(ids: list[int], block_tokens: int) -> PromptHint:
    # Decimal text, so any integer hashes (ids out of range are the engine's to refuse, not a crash here).
    pieces = [
        ",".join(map(str, ids[i : i + block_tokens])).encode()
        for i in range(0, min(len(ids), MAX_BLOCKS * block_tokens) - block_tokens + 1, block_tokens)
    ]
    return PromptHint(float(len(ids)), _chain(pieces), block_tokens)


def prompt_hint(body: dict[str, Any], block_tokens: int = DEFAULT_BLOCK_TOKENS) -> PromptHint:
    """The hint for an OpenAI ``/v1/chat/completions`` or ``/v1/completions`` body (already parsed
    JSON). Anything it cannot read counts as an empty prompt: validation is the engine's job."""
    messages = body.get("messages")
    if isinstance(messages, list):
        # Role and content of every message, in order: two chats share a prefix block only if
        # their first messages agree, as their templated prompts would.
        text = "".join(
            json.dumps([m.get("role"), _text_of_content(m.get("content"))]) for m in messages if isinstance(m, dict)
        )
        return _hint_for_text(text, block_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _hint_for_text(prompt, block_tokens)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return _hint_for_ids(prompt, block_tokens)
        # A batch: its first prompt decides the prefix, all of them count.
        hints = [prompt_hint({"prompt": p}, block_tokens) for p in prompt[:64]]
        return PromptHint(sum(h.prompt_tokens for h in hints), hints[0].prefix_blocks, block_tokens)
    return PromptHint(0.0, (), block_tokens)
