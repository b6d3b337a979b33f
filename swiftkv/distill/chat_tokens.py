"""Chat template + loss mask: token ids of a conversation and which positions the KL counts.

Most chat templates (Llama-3.1, Qwen2.5, Mistral, SmolLM2's ChatML) have no ``{% generation %}``
markers, so transformers' ``return_assistant_tokens_mask`` cannot be used. Instead:

1. The whole conversation is rendered once and tokenized once, so the ids are exactly the ones the
   template gives (tokenizing pieces one by one can differ: SentencePiece adds "▁" at the start of
   a call, byte-level BPE merges across a cut such as "\\n" | "\\nreply").
2. The assistant turns are found by rendering the conversation again with every reply replaced by
   its own marker: putting the replies back in place of the markers must give the full rendering
   exactly. Where it does not (Llama-3.1 trims a reply with spaces at its ends), each reply is
   found alone: the conversation rendered with that reply replaced by a marker, the text before and
   after it being the full rendering's own start and end (one rendering per reply, which costs a
   long conversation its length squared). This holds for templates that move other text between
   renderings too (Mistral v0.3 puts the system prompt into the last user turn, and leaves it out
   when the conversation ends on a reply).
   The turn's span is its reply as rendered plus its end-of-turn text: what the template puts
   after a reply that ends the conversation, as far as this turn has it too ("<|eot_id|>",
   "<|im_end|>\\n", "</s>").
3. The spans are laid on the tokens with the fast tokenizer's offsets. A token belongs to a turn
   when any of its characters lies in the span, so a SentencePiece "▁Paris" that carries the
   template's space before the reply is the reply's first token.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jinja2 import TemplateError, TemplateSyntaxError

from swiftkv.chat_schemas import MalformedRow, Message

if TYPE_CHECKING:  # transformers costs seconds to import: Ray Data's read tasks never need it
    from transformers import PreTrainedTokenizerBase

# Stands in for a reply: private-use characters no conversation carries and no template trims.
_MARKER = "\ue000swiftkv-reply\ue001"


@dataclass
class ChatTokens:
    input_ids: list[int]
    loss_mask: list[int]
    """``loss_mask[t] = 1`` when position ``t``'s logits are trained, i.e. when token ``t + 1`` is
    selected (an assistant token, or any token for ``loss_on="all"``)."""


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateSyntaxError:
        raise  # a broken template stops the run: every row would fail
    except TemplateError as err:  # the template refuses this conversation (``raise_exception``)
        raise MalformedRow(f"the chat template refuses the conversation: {err}") from None


def _around_marker(tokenizer: PreTrainedTokenizerBase, messages: list[Message], k: int) -> tuple[str, str]:
    """The conversation rendered with message ``k``'s content replaced by the marker: the text before and after it."""
    marked = [*messages[:k], {**messages[k], "content": _MARKER}, *messages[k + 1 :]]
    parts = _render(tokenizer, marked).split(_MARKER)
    if len(parts) != 2:
        raise MalformedRow("the chat template does not render each reply once")
    return parts[0], parts[1]


def _closing(tokenizer: PreTrainedTokenizerBase, messages: list[Message], k: int, text: str, end: int) -> int:
    """The length of the end-of-turn text after reply ``k`` (ending at ``end`` in ``text``): what follows
    the reply when the conversation ends on it, as far as this turn has it too (a template may add more
    after the very last message)."""
    _, closing = _around_marker(tokenizer, messages[: k + 1], k)
    return len(os.path.commonprefix([closing, text[end:]]))


def _spans_in_one_rendering(
    tokenizer: PreTrainedTokenizerBase, messages: list[Message], text: str, turns: list[int]
) -> list[tuple[int, int]] | None:
    """Every reply's span from one rendering with all replies marked, when the template renders each
    reply verbatim and the rest the same (putting the replies back gives ``text`` exactly) and ends
    every turn alike; ``None`` otherwise (a template that trims a reply with spaces at its ends)."""
    markers = [f"\ue000swiftkv-reply-{k}\ue001" for k in turns]
    marked = [dict(m) for m in messages]
    for k, marker in zip(turns, markers, strict=True):
        marked[k]["content"] = marker
    rendered = _render(tokenizer, marked)
    pieces: list[str] = []
    for marker in markers:
        before, sep, rendered = rendered.partition(marker)
        if not sep or marker in rendered:
            return None
        pieces.append(before)
    if "".join(p + messages[k]["content"] for p, k in zip(pieces, turns, strict=True)) + rendered != text:
        return None
    spans, position = [], 0
    for piece, k in zip(pieces, turns, strict=True):
        start = position + len(piece)
        position = start + len(messages[k]["content"])
        spans.append((start, position))
    closing = _closing(tokenizer, messages, turns[0], text, spans[0][1])
    if _closing(tokenizer, messages, turns[-1], text, spans[-1][1]) != closing:
        return None
    return [(start, end + closing) for start, end in spans]


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span ``[start, end)`` of each assistant turn in it."""
    text = _render(tokenizer, messages)
    turns = [k for k, message in enumerate(messages) if message["role"] == "assistant"]
    if turns and (fast := _spans_in_one_rendering(tokenizer, messages, text, turns)) is not None:
        return text, fast
    spans: list[tuple[int, int]] = []
    for k in turns:
        before, after = _around_marker(tokenizer, messages, k)
        start, end = len(before), len(text) - len(after)
        in_place = text.startswith(before) and text.endswith(after) and start <= end
        if not in_place or (spans and start < spans[-1][1]):
            raise MalformedRow("the chat template does not render this conversation's replies in place")
        spans.append((start, end + _closing(tokenizer, messages, k, text, end)))
    return text, spans


def token_turns(tokenizer: PreTrainedTokenizerBase, messages: list[Message]) -> tuple[list[int], list[int]]:
    """Token ids of the whole rendered conversation and, for each token, the assistant turn (1-based) it
    belongs to, 0 for context."""
    if not tokenizer.is_fast:
        # Without offsets the replies cannot be placed on the tokens of the whole text; piecewise
        # tokenizing is what this module exists to avoid, and a config error should stop the run.
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer without offset mappings; load the model's fast "
            "tokenizer (AutoTokenizer.from_pretrained with the model's tokenizer.json, or the `tokenizers` package "
            "installed so transformers can convert it)"
        )
    text, spans = assistant_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ends = [end for _, end in spans]
    turn_of = []
    for start, end in encoding["offset_mapping"]:
        k = bisect.bisect_right(ends, start)  # the first span ending after the token starts
        # A zero-width token (rare) counts at its position.
        turn_of.append(k + 1 if k < len(spans) and spans[k][0] < max(end, start + 1) else 0)
    return encoding["input_ids"], turn_of


def tokenize_chat(tokenizer: PreTrainedTokenizerBase, messages: list[Message], loss_on: str) -> ChatTokens:
    """Token ids of the templated conversation and its loss mask (see ``ChatTokens``)."""
    ids, turn_of = token_turns(tokenizer, messages)
    selected = [int(turn > 0 or loss_on == "all") for turn in turn_of]
    if not any(selected[1:]):
        raise MalformedRow("no token to train on after templating")
    # Position t predicts token t + 1: shift the selection left by one.
    return ChatTokens(input_ids=ids, loss_mask=selected[1:] + [0])
