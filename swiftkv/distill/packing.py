"""Pack tokenized examples into fixed-length rows with attention kept inside each example.

A row carries ``input_ids``, ``position_ids`` and ``loss_mask``. Position ids restart at 0 for
every example, and the model is called with no attention mask (and no cache): transformers 5 then
reads the restarts as a packed batch (``masking_utils.find_packed_sequence_indices``) and builds a
block-diagonal causal mask, for sdpa and eager alike. Padding at the end of a row is one more
"example" (positions restarting at 0) whose positions are never trained.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from swiftkv.distill.chat_tokens import ChatTokens

Row = dict[str, np.ndarray]


def _bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of the examples that go into each row."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _row(examples: list[ChatTokens], max_seq_len: int, pad_id: int) -> Row:
    ids = np.full(max_seq_len, pad_id, dtype=np.int64)
    mask = np.zeros(max_seq_len, dtype=np.int64)
    pos = np.zeros(max_seq_len, dtype=np.int64)
    start = 0
    for ex in examples:
        end = start + len(ex.input_ids)
        ids[start:end] = ex.input_ids
        mask[start:end] = ex.loss_mask
        pos[start:end] = np.arange(end - start)
        start = end
    pos[start:] = np.arange(max_seq_len - start)  # the padding restarts the positions too
    return {"input_ids": ids, "position_ids": pos, "loss_mask": mask}


def truncate(example: ChatTokens, max_seq_len: int) -> ChatTokens:
    """Cut an over-long example; its last kept position has no next token inside the row."""
    if len(example.input_ids) <= max_seq_len:
        return example
    return ChatTokens(example.input_ids[:max_seq_len], example.loss_mask[: max_seq_len - 1] + [0])


def pack_rows(examples: Iterable[ChatTokens], max_seq_len: int, pad_id: int, pack: bool = True) -> list[Row]:
    """Rows of exactly ``max_seq_len`` tokens; with ``pack=False`` one example per row."""
    examples = [truncate(ex, max_seq_len) for ex in examples]
    if pack:
        groups = _bins([len(ex.input_ids) for ex in examples], max_seq_len)
    else:
        groups = [[i] for i in range(len(examples))]
    return [_row([examples[i] for i in group], max_seq_len, pad_id) for group in groups]
