"""Layer similarity (the paper's SimScore) of any causal LM on chat data, to choose the cutoff.

``x_l`` is the hidden state entering layer ``l`` (``hidden_states[l]`` of a forward with
``output_hidden_states=True``, for ``l = 0..L-1``). ``similarity[l][j]`` is the mean over all
non-padding tokens of ``cos(x_l, x_j)``; ``SimScore(l)`` is the mean of ``similarity[l][j]`` over
``j > l`` (defined for ``l = 0..L-2``). ``SimScore(c)`` scores cutoff ``c``: SwiftKV computes the K/V
of layers ``j >= c`` from ``x_c``.

Suggestion rule (the paper gives none; it reports SimScore passing about 0.5 near half depth where
50% SwiftKV works): for each target share ``F`` of skipped layers the cutoff is
``c = ceil(L (1 - F))`` (never skipping more than ``F``), flagged when ``SimScore(c)`` is below the
threshold. The recommended cutoff is the smallest ``c >= L/2`` such that every ``SimScore(c')`` with
``c <= c' <= L-2`` clears the threshold: never past half depth, where the paper's quality falls off
a cliff (62.5% SwiftKV cost Llama-3.1-8B 7.6 points), and never onto a dip of the curve.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from swiftkv.bundled import BUNDLED, bundled_chat_data
from swiftkv.chat_schemas import MalformedRow, to_messages
from swiftkv.config import DEFAULT_SIMSCORE_THRESHOLD, cutoff_from_fraction
from swiftkv.model_source import resolve_model

logger = logging.getLogger(__name__)

TARGET_SHARES = (0.25, 0.5, 0.75)

Messages = list[dict[str, str]]


def _row_format(row) -> tuple[str, dict]:
    """Guess a row's chat schema (see ``swiftkv.chat_schemas``); a bare list is a messages list."""
    if isinstance(row, list):
        return "messages", {"messages": row}
    if isinstance(row, dict) and "conversations" in row:
        return "openhermes", row
    if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
        return ("chitchat" if isinstance(row["messages"][0], list) else "messages"), row
    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise MalformedRow(f"no 'messages' or 'conversations' list (got {keys})")


def _read_rows(path: Path) -> list:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        return list(data.values()) if isinstance(data, dict) else data  # chitchat: {id: conversation}
    raise ValueError(f"{path}: unknown data file type {path.suffix!r} (use .jsonl, .json or .parquet)")


def load_conversations(data: str | Path, num_samples: int) -> list[Messages]:
    """The first ``num_samples`` usable conversations of a chat file, or of the bundled chitchat data.
    Rows that do not fit their schema (or have no assistant turn) are skipped and counted."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if str(data) == BUNDLED:
        return bundled_chat_data(limit=num_samples)
    path = Path(data)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    conversations, skipped = [], 0
    for row in _read_rows(path):
        try:
            conversations.append(to_messages(*_row_format(row)))
        except MalformedRow as err:
            skipped += 1
            logger.debug("skipping row: %s", err)
        if len(conversations) == num_samples:
            break
    if skipped:
        logger.info("skipped %d rows of %s that are not usable chat conversations", skipped, path)
    if not conversations:
        raise ValueError(f"{path} holds no usable chat conversations (skipped {skipped} rows)")
    return conversations


def load_model(model: str | Path):
    """Model and tokenizer in float32, for any model reference (``swiftkv.model_source``). SwiftKV
    checkpoints run as their teacher, so every token passes every layer."""
    from swiftkv.inference import as_student, load_chat_model

    path = resolve_model(model)
    lm, tokenizer = load_chat_model(path)
    if not tokenizer.chat_template:
        raise ValueError(f"the tokenizer of {path} has no chat template")
    return as_student(lm, False), tokenizer


def _batches(tokenizer, conversations: Sequence[Messages], max_len: int, batch_size: int) -> Iterable[dict]:
    texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in conversations]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    for i in range(0, len(texts), batch_size):
        yield tokenizer(
            texts[i : i + batch_size],
            add_special_tokens=False,  # the chat template already has them
            truncation=True,
            max_length=max_len,
            padding=True,
            return_tensors="pt",
        )


@torch.no_grad()
def layer_similarity(model, batches: Iterable[dict], total: int | None = None) -> tuple[torch.Tensor, int]:
    """``(similarity, num_tokens)``: the L x L matrix of mean cosine similarity between layer inputs
    over all non-padding tokens."""
    num_layers = model.config.num_hidden_layers
    sums = torch.zeros(num_layers, num_layers, dtype=torch.float64)
    tokens = 0
    for batch in tqdm(batches, total=total, desc="simscore", unit="batch"):
        out = model(**batch, output_hidden_states=True, use_cache=False, logits_to_keep=1)
        keep = batch["attention_mask"].bool()
        # Layer inputs 0..L-1 (the last entry is the final norm's output), padding dropped: [L, N, H].
        states = torch.stack([h[keep].float() for h in out.hidden_states[:num_layers]])
        unit = torch.nn.functional.normalize(states, dim=-1)
        sums += torch.einsum("lnh,mnh->lm", unit, unit).double()  # float64 sums over many batches
        tokens += int(keep.sum())
    if tokens == 0:
        raise ValueError("no tokens to score")
    return sums / tokens, tokens


def simscore_curve(similarity: torch.Tensor) -> list[float]:
    """``SimScore(l)`` for ``l = 0..L-2``: mean similarity to every later layer's input."""
    n = similarity.shape[0]
    return [float(similarity[layer, layer + 1 :].mean()) for layer in range(n - 1)]


@dataclass
class CutoffSuggestion:
    share: float
    """Target share of layers that prompt tokens skip."""
    num_key_value_layers: int
    """The cutoff ``c = ceil(L (1 - share))``."""
    simscore: float
    """``SimScore(c)``."""
    below_threshold: bool
    """``SimScore(c)`` is under the threshold: expect a larger quality loss."""


@dataclass
class SimScoreResult:
    model: str
    data: str
    num_samples: int
    num_tokens: int
    max_len: int
    threshold: float
    similarity: list[list[float]]
    """``similarity[l][j]``: mean over tokens of ``cos(x_l, x_j)``."""
    simscore: list[float]
    """``SimScore(l)`` for ``l = 0..L-2``."""
    targets: list[CutoffSuggestion] = field(default_factory=list)
    recommended_num_key_value_layers: int | None = None
    """Smallest ``c >= L/2`` with ``SimScore(c') >= threshold`` for every ``c' >= c``; ``None`` if none."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def suggest_cutoffs(curve: Sequence[float], threshold: float) -> tuple[list[CutoffSuggestion], int | None]:
    """The module docstring's rule, applied to a SimScore curve of a model with ``len(curve) + 1`` layers."""
    num_layers = len(curve) + 1
    targets = []
    for share in TARGET_SHARES:
        c = cutoff_from_fraction(num_layers, share)
        score = curve[c] if c < len(curve) else float("nan")  # SimScore(L-1) is undefined
        targets.append(CutoffSuggestion(share, c, score, not score >= threshold))
    recommended = None
    for c in range(len(curve) - 1, math.ceil(num_layers / 2) - 1, -1):
        if curve[c] < threshold:
            break
        recommended = c
    return targets, recommended


def compute_simscore(
    model: str | Path,
    data: str | Path = BUNDLED,
    num_samples: int = 64,
    max_len: int = 512,
    batch_size: int = 4,
    threshold: float = DEFAULT_SIMSCORE_THRESHOLD,
) -> SimScoreResult:
    if max_len < 2 or batch_size < 1:
        raise ValueError(f"max_len must be >= 2 and batch_size >= 1 (got {max_len}, {batch_size})")
    conversations = load_conversations(data, num_samples)
    lm, tokenizer = load_model(model)
    batches = _batches(tokenizer, conversations, max_len, batch_size)
    similarity, tokens = layer_similarity(lm, batches, total=math.ceil(len(conversations) / batch_size))
    curve = simscore_curve(similarity)
    targets, recommended = suggest_cutoffs(curve, threshold)
    return SimScoreResult(
        model=lm.name_or_path,
        data=str(data),
        num_samples=len(conversations),
        num_tokens=tokens,
        max_len=max_len,
        threshold=threshold,
        similarity=similarity.tolist(),
        simscore=curve,
        targets=targets,
        recommended_num_key_value_layers=recommended,
    )


def save_result(result: SimScoreResult, out_dir: str | Path) -> list[Path]:
    """Write ``simscore.json``, ``simscore.png`` (the curve) and ``similarity.png`` (the matrix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "simscore.json", out / "simscore.png", out / "similarity.png"]
    paths[0].write_text(result.to_json() + "\n")
    title = f"{Path(result.model).name}: {result.num_samples} conversations, {result.num_tokens} tokens"

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(len(result.simscore)), result.simscore, marker="o", markersize=3, label="SimScore(l)")
    ax.axhline(result.threshold, color="grey", linestyle="--", label=f"threshold {result.threshold}")
    for t in result.targets:
        ax.axvline(t.num_key_value_layers, color="red" if t.below_threshold else "green", alpha=0.4, linestyle=":")
        ax.annotate(f"{t.share:.0%}", (t.num_key_value_layers, 0.02), ha="center", fontsize=8)
    ax.set(xlabel="layer l (cutoff c)", ylabel="mean cos(x_l, x_j), j > l", ylim=(0, 1), title=title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    image = ax.imshow(result.similarity, vmin=0, vmax=1, cmap="viridis", origin="lower")
    fig.colorbar(image, ax=ax, label="mean cos(x_l, x_j)")
    ax.set(xlabel="layer j", ylabel="layer l", title=title)
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=120)
    plt.close(fig)
    return paths
