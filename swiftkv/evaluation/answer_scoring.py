"""Teacher-forced answer scores: does a model put its probability on an answer stated in its prompt?

One forward over ``prompt + answer`` gives two figures per sample:

- ``exact``: every answer token is the argmax at its position. That is exactly "greedy decoding,
  continuing the prompt, starts with the answer" (each greedy step sees the same context as the
  forced one as long as all earlier steps matched), so it is the exact-match rate of greedy
  generation without generating.
- ``logprob``: the answer's log-probability (summed over its tokens). It moves with every
  training step, where an exact-match rate of 0% or 100% does not, so a short run already shows
  its direction.

A SwiftKV checkpoint holds its own base (the teacher: SwiftKV off), so both are scored on the same
sample: the student's figures and the base's, sharing the layers before the cutoff, which are the
same in both. The student's logits here are those of its full forward, which equal the prefill-
skipping path's (tests/test_modeling.py holds the two equal). Any other checkpoint is its own base.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class AnswerScore:
    logprob: float
    exact: bool


def score_hidden(model, hidden: torch.Tensor, answer: list[int]) -> AnswerScore:
    """The answer's scores from the final hidden states of the last ``len(answer) + 1`` positions
    (the prompt's last token, then the answer's)."""
    logits = model.get_output_embeddings()(hidden[:-1]).float()
    logprobs = torch.log_softmax(logits, -1)
    target = torch.tensor(answer)
    return AnswerScore(float(logprobs[torch.arange(len(answer)), target].sum()),
                       bool((logits.argmax(-1) == target).all()))


@torch.inference_mode()
def score_answer(model, prompt: list[int], answer: list[int]) -> dict[str, AnswerScore]:
    """``{"model": ..., "base": ...}`` for one sample (for a checkpoint that is not SwiftKV, both
    are the model's own). A SwiftKV model is left in student mode."""
    ids = torch.tensor([prompt + answer])
    keep = slice(len(prompt) - 1, None)
    if not hasattr(model, "swiftkv"):
        hidden = model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        out = score_hidden(model, hidden[0, keep], answer)
        return {"model": out, "base": out}
    decoder = model.get_decoder()
    state = decoder(input_ids=ids, swiftkv_layers="to_cutoff", use_cache=False).last_hidden_state
    scores = {}
    for name, student in (("base", False), ("model", True)):
        model.swiftkv(student)
        hidden = decoder(inputs_embeds=state, swiftkv_layers="from_cutoff", use_cache=False).last_hidden_state
        scores[name] = score_hidden(model, hidden[0, keep], answer)
    return scores


def summarise(samples: Iterable[dict[str, AnswerScore]]) -> dict[str, float]:
    """A cell's figures: ``n``; ``exact`` and ``base_exact`` (shares); ``logprob`` and
    ``base_logprob`` (means); ``delta`` (mean of the paired differences, model minus base) and
    ``delta_stderr`` (its standard error)."""
    samples = list(samples)
    deltas = [s["model"].logprob - s["base"].logprob for s in samples]
    n = len(samples)
    return {
        "n": n,
        "exact": sum(s["model"].exact for s in samples) / n,
        "base_exact": sum(s["base"].exact for s in samples) / n,
        "logprob": statistics.fmean(s["model"].logprob for s in samples),
        "base_logprob": statistics.fmean(s["base"].logprob for s in samples),
        "delta": statistics.fmean(deltas),
        "delta_stderr": statistics.stdev(deltas) / math.sqrt(n) if n > 1 else 0.0,
    }


def pool(cells: list[dict[str, float]]) -> dict[str, float]:
    """Several cells' figures as one (e.g. a length over its depths): the shares and the mean
    difference weighted by the cells' ``n``, the difference's standard error from the cells' (each
    cell's mean independent of the others'), and the total ``n``."""
    n = sum(c["n"] for c in cells)
    out = {key: sum(c[key] * c["n"] for c in cells) / n for key in ("exact", "base_exact", "delta")}
    out["delta_stderr"] = math.sqrt(sum((c["n"] * c["delta_stderr"]) ** 2 for c in cells)) / n
    return out | {"n": n}
