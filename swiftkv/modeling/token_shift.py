"""The token shift: each token's SwiftKV K/V on chosen layers also read the normed cutoff state of
the tokens just before it (config ``key_value_shift_layers`` / ``key_value_shift_tokens``).

Why (docs/distillation.md, "Token shift"): a layer whose keys read a previous-token head that sits
after the cutoff cannot get that information from its own token's cutoff state; the token before's
cutoff state carries it. The tokens before a sequence's first token count as zeros; a token's
position says where its sequence starts, so packed training rows (restarting positions) and
left-padded batches (positions counted from the first real token) need no mask of their own.

Decoding keeps the last ``key_value_shift_tokens`` normed states of each sequence on the
transformers cache object (``swiftkv_recent_states``), read and written only here; beam search,
which reorders the cache, is refused (``SwiftKVForCausalLMMixin.generate``).
"""

from __future__ import annotations

import torch

RECENT_ATTRIBUTE = "swiftkv_recent_states"


def shifted_states(
    normed: torch.Tensor, position_ids: torch.Tensor, tokens: int, recent: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``normed`` ``[B, T, H]``, the new tokens' ``norm_swiftkv(h_c)``; ``recent`` ``[B, tokens, H]``,
    the states of the ``tokens`` tokens before them (``None``: there are none).

    Returns ``[B, T, tokens * H]``, the states of the tokens ``t-1, ..., t-tokens`` side by side
    (zero where that token lies before the sequence's start, ``position < s``), and the last
    ``tokens`` states, the ``recent`` of the next call."""
    batch, length, width = normed.shape
    if recent is None:
        recent = normed.new_zeros(batch, tokens, width)
    joined = torch.cat([recent, normed], dim=1)  # joined[:, tokens + t] is token t
    parts = [joined[:, tokens - s: tokens - s + length] * (position_ids >= s).unsqueeze(-1).to(normed.dtype)
             for s in range(1, tokens + 1)]
    return torch.cat(parts, dim=-1), joined[:, -tokens:]


def shifted_for_cache(normed: torch.Tensor, position_ids: torch.Tensor, tokens: int, cache) -> torch.Tensor:
    """:func:`shifted_states` of the new tokens, continuing from the states kept on ``cache`` (a
    transformers cache, or ``None`` without one) and keeping theirs there for the next step."""
    recent = getattr(cache, RECENT_ATTRIBUTE, None) if cache is not None else None
    if recent is not None and recent.shape[0] != normed.shape[0]:
        raise ValueError(f"the cache holds {recent.shape[0]} sequences' recent SwiftKV states, the input "
                         f"{normed.shape[0]}: the token shift does not support beam search or a reordered cache")
    shifted, recent = shifted_states(normed, position_ids, tokens, recent)
    if cache is not None:
        setattr(cache, RECENT_ATTRIBUTE, recent)
    return shifted
