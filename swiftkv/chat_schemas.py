"""Map each public chat schema onto one shape: a list of ``{"role", "content"}`` messages.

- UltraChat-200k (and the generic ``messages`` format): ``messages: [{role, content}]``.
- OpenHermes-2.5 and SlimOrca: ``conversations: [{from, value}]`` with ``system``/``human``/``gpt``.
- chitchat-dataset: ``messages: [[{text, sender, ...}], ...]``, one inner list per turn of one
  sender; converted exactly as ``swiftkv.bundled`` converts its bundled copy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from swiftkv.bundled import chitchat_messages

Message = dict[str, str]

_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant"}
_ROLES = ("system", "user", "assistant")


class MalformedRow(ValueError):
    """A row that does not fit its declared schema; the pipeline counts and skips it."""


def _is_nonempty_list(value: Any) -> bool:
    # Ray hands nested columns over as lists or numpy arrays, depending on the block format.
    return not isinstance(value, (str, bytes, Mapping)) and hasattr(value, "__len__") and len(value) > 0


def _field(row: Mapping[str, Any], name: str) -> list:
    value = row.get(name)
    if not _is_nonempty_list(value):
        raise MalformedRow(f"no non-empty list in column {name!r}")
    return list(value)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise MalformedRow(f"{what} is not a non-empty string")
    return value


def _from_messages(row: Mapping[str, Any]) -> list[Message]:
    out = []
    for i, msg in enumerate(_field(row, "messages")):
        role = msg.get("role") if isinstance(msg, Mapping) else None
        if role not in _ROLES:
            raise MalformedRow(f"messages[{i}] has role {role!r}, expected one of {_ROLES}")
        out.append({"role": role, "content": _text(msg.get("content"), f"messages[{i}].content")})
    return out


def _from_sharegpt(row: Mapping[str, Any]) -> list[Message]:
    out = []
    for i, turn in enumerate(_field(row, "conversations")):
        speaker = turn.get("from") if isinstance(turn, Mapping) else None
        if speaker not in _SHAREGPT_ROLES:
            raise MalformedRow(f"conversations[{i}] is from {speaker!r}, expected system/human/gpt")
        out.append({"role": _SHAREGPT_ROLES[speaker], "content": _text(turn.get("value"), f"conversations[{i}].value")})
    return out


def _from_chitchat(row: Mapping[str, Any]) -> list[Message]:
    turns = []
    for i, turn in enumerate(_field(row, "messages")):
        if not _is_nonempty_list(turn):
            raise MalformedRow(f"messages[{i}] is not a list of utterances")
        for u in turn:
            if not isinstance(u, Mapping) or not isinstance(u.get("text"), str) or "sender" not in u:
                raise MalformedRow(f"messages[{i}] has an utterance without text and sender")
        turns.append(list(turn))
    # The same conversion as the bundled chat data: the first sender is the user.
    return chitchat_messages(turns)


_CONVERTERS: dict[str, Callable[[Mapping[str, Any]], list[Message]]] = {
    "ultrachat": _from_messages,
    "messages": _from_messages,
    "openhermes": _from_sharegpt,
    "slimorca": _from_sharegpt,
    "chitchat": _from_chitchat,
}


def to_messages(fmt: str, row: Mapping[str, Any]) -> list[Message]:
    """The row as chat messages; raises ``MalformedRow`` saying what is wrong with it."""
    try:
        convert = _CONVERTERS[fmt]
    except KeyError:
        raise ValueError(f"unknown data format {fmt!r}; expected one of {sorted(_CONVERTERS)}") from None
    messages = convert(row)
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedRow("conversation has no assistant turn")
    return messages
