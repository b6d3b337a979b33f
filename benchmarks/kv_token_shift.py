"""Do the SwiftKV K/V need the tokens before? Least-squares K/V from the cutoff state of a token and
of the tokens just before it, and what they do to needle retrieval.

    python -m benchmarks.kv_token_shift --set model=artifacts/frontier/swiftkv-c15/step_00000060/model

A SwiftKV layer ``j >= c`` makes its keys and values from one vector per token, ``x_t =
norm_swiftkv(h_c)`` at that token. The teacher's ``K_j`` at token ``t`` may also depend on the tokens
before it, written into the residual stream by the attention of layers ``c .. j-1`` (a previous-token
head feeding an induction head is the textbook case, and needle retrieval is copying). This fits each
later layer's teacher K/V (before rotary) by least squares on ``[x_t, x_{t-1}, ..., x_{t-n+1}]`` for
each ``n`` of ``shifts``, on needle prompts over one filler text, and scores the fits' R² on prompts
over another text (no text shared). Then, on the needle probe's prompts (``swiftkv.evaluation.needle``:
the evaluation's prompts with the same seed and lengths), the student is scored teacher-forced on the
number with its SwiftKV K/V replaced by each fit: in every later layer, and in single ``layers``
alone (by default the layer whose keys gain most from the tokens before). The queries and everything
else stay the checkpoint's. ``kv_token_shift.json`` and ``kv_token_shift.md`` land in ``out``. Families
with k/v projections (not DeepSeek-V2), without AcrossKV.
"""

from __future__ import annotations

import json
import random
from typing import Annotated

import torch
from pydantic import Field

from benchmarks.retrieval_layers import NeedleProbeConfig, Replacement, score_needles
from swiftkv.least_squares_init import KINDS, Moments, capture_teacher_kv
from swiftkv.modeling.token_shift import shifted_states
from swiftkv.yaml_config import job_main


class KVTokenShiftConfig(NeedleProbeConfig):
    """The probe's fields (``lengths``, ``depths``, ``samples``, ``filler``, ``seed``) are the
    evaluation's needle prompts the fits are scored on; ``filler`` must differ from ``fit_filler``."""

    model: str
    """A SwiftKV checkpoint folder (a distilled one, e.g. ``<run>/step_*/model``)."""

    shifts: list[Annotated[int, Field(ge=1)]] = Field(default=[1, 2, 3], min_length=1)
    """Fits to compare: ``n`` = the token's own cutoff state and those of the ``n - 1`` tokens before it."""

    fit_filler: str = "squad"
    """Filler text of the prompts the fits are solved on (``essays`` or ``squad``)."""

    fit_rows: int = Field(default=24, ge=2)
    """Prompts the fits are solved on."""

    heldout_rows: int = Field(default=6, ge=1)
    """Prompts over the probe's filler (``filler``) the fits' R² is scored on."""

    row_tokens: int = Field(default=2048, ge=64)
    """Length of the fit and held-out prompts."""

    ridge: float = Field(default=1e-4, ge=0)
    """Added to the diagonal of ``X^T X``, relative to its mean diagonal."""

    layers: list[int] | None = None
    """Layers whose K/V are also replaced alone; ``None``: the layer whose keys' R² gains most from the
    longest shift."""

    out: str = "artifacts/kv-token-shift"
    """Output folder."""


def token_features(x: torch.Tensor, n: int) -> torch.Tensor:
    """``[T, H]`` cutoff states of one sequence -> ``[T, n * H + 1]``: each token's own state, those of
    the ``n - 1`` tokens before it (the model's token shift: zeros before the first token) and a
    column of ones (a bias)."""
    before = [shifted_states(x[None], torch.arange(len(x))[None], n - 1)[0][0]] if n > 1 else []
    return torch.cat([x, *before, x.new_ones(len(x), 1)], dim=1)


@torch.no_grad()
def fit_shifted_kv(
    model, splits: dict[str, list[list[int]]], shifts: list[int], ridge: float
) -> tuple[dict[tuple[int, str], torch.Tensor], dict[int, dict[str, float]]]:
    """Least-squares fits of every later layer's teacher K/V on ``token_features(x, n)``.

    ``splits``: ``{"fit": rows, "heldout": rows}`` of token ids. Returns the weights keyed ``(n,
    "k18")`` and, per ``n``, the held-out R² keyed ``"k18"``, ``"v18"``, ... The model is left in
    teacher mode."""
    decoder = model.get_decoder()
    layers, c = decoder.layers, model.config.num_key_value_layers
    names = [f"{kind}{j}" for j in range(c, len(layers)) for kind in KINDS]
    width = model.config.hidden_size
    moments = {(split, n): Moments.empty(n * width + 1) for split in splits for n in shifts}
    seen, handles = capture_teacher_kv(model, c, range(c, len(layers)))
    model.swiftkv(False)
    try:
        for split, rows in splits.items():
            for row in rows:
                decoder(input_ids=torch.tensor([row]), use_cache=False)
                x = decoder.norm_swiftkv(seen["h"])[0].double()
                targets = {name: seen[name][0].double() for name in names}
                for n in shifts:
                    moments[(split, n)].add(token_features(x, n), targets)
    finally:
        for handle in handles:
            handle.remove()
    weights, r2 = {}, {}
    for n in shifts:
        r2[n] = {}
        for name in names:
            weights[(n, name)] = moments[("fit", n)].solve(name, ridge)
            r2[n][name] = moments[("heldout", n)].r2(name, weights[(n, name)])
    return weights, r2


def shifted_replacement(weights: dict[tuple[int, str], torch.Tensor], n: int) -> Replacement:
    """The fitted K/V of ``n`` tokens in place of a SwiftKV projection's output (batch of one)."""
    def replace(layer: int, kind: str, swiftkv_input: torch.Tensor, _own: torch.Tensor) -> torch.Tensor:
        out = token_features(swiftkv_input[0].double(), n) @ weights[(n, f"{kind}{layer}")]
        return out.to(swiftkv_input.dtype)[None]
    return replace


def run(cfg: KVTokenShiftConfig) -> dict:
    from swiftkv.evaluation.needle import KEYS, NeedlePrompts, filler_text, needle_samples
    from swiftkv.inference import load_chat_model
    from swiftkv.outputs import write_files

    if cfg.fit_filler == cfg.filler:
        raise ValueError(f"fit_filler and filler are both {cfg.filler!r}: the fits must be scored on other text")
    model, tokenizer = load_chat_model(cfg.model)
    config = model.config
    if (not hasattr(model, "swiftkv") or getattr(config, "key_value_group_size", 1) != 1
            or not hasattr(model.get_decoder().layers[-1].self_attn, "k_proj_swiftkv")):
        raise ValueError(f"{cfg.model}: a SwiftKV checkpoint with k/v projections and without AcrossKV is needed")
    c, last, longest = config.num_key_value_layers, config.num_hidden_layers, max(cfg.shifts)
    if cfg.layers is not None and not set(cfg.layers) <= set(range(c, last)):
        raise ValueError(f"layers {cfg.layers}: each must be a SwiftKV layer of {cfg.model} ({c} to {last - 1})")
    rng = random.Random(cfg.seed + 1)
    # The fit rows span 8x the row length of their filler, so they repeat little text.
    fit_prompts = NeedlePrompts(tokenizer, filler_text(cfg.fit_filler), 8 * cfg.row_tokens)
    fit_rows = []
    for _ in range(cfg.fit_rows):
        prompt, answer = fit_prompts.build(cfg.row_tokens, rng.random(), rng.choice(KEYS),
                                           str(rng.randrange(1_000_000, 10_000_000)), rng)
        fit_rows.append(prompt + answer)
    heldout_rows = [prompt + answer for *_, prompt, answer in needle_samples(
        tokenizer, cfg.filler, [cfg.row_tokens], [0.5], cfg.heldout_rows, cfg.seed + 1)]
    print(f"fitting K/V of layers {c}-{last - 1} on "
          f"{len(fit_rows)} {cfg.fit_filler} prompts, scoring on {len(heldout_rows)} {cfg.filler} prompts", flush=True)
    weights, r2 = fit_shifted_kv(model, {"fit": fit_rows, "heldout": heldout_rows}, cfg.shifts, cfg.ridge)

    every = list(range(c, last))
    alone = cfg.layers if cfg.layers is not None else [
        max(every, key=lambda j: r2[longest][f"k{j}"] - r2[min(cfg.shifts)][f"k{j}"])]
    variants: dict[str, list[int]] = {"student": []}
    replacements: dict[str, Replacement] = {}
    for n in cfg.shifts:
        for name, replaced in [(f"{n} token(s), layers {c}-{last - 1}", every),
                               *[(f"{n} token(s), layer {j}", [j]) for j in alone]]:
            variants[name], replacements[name] = replaced, shifted_replacement(weights, n)
    table, retrieval_lines = score_needles(model, tokenizer, cfg, variants, replacements,
                                           label="SwiftKV K/V replaced by the fit of")
    result = {"model": cfg.model, "cutoff": c, "fit_filler": cfg.fit_filler, "filler": cfg.filler,
              "heldout_r2": {str(n): values for n, values in r2.items()}, "retrieval": table}
    lines = ["| layer | " + " | ".join(f"K R², {n} token(s)" for n in cfg.shifts) + " | "
             + " | ".join(f"V R², {n} token(s)" for n in cfg.shifts) + " |", "|---" * (1 + 2 * len(cfg.shifts)) + "|"]
    for j in every:
        cells = [f"{r2[n][f'{kind}{j}']:.2f}" for kind in KINDS for n in cfg.shifts]
        lines.append(f"| {j} | " + " | ".join(cells) + " |")
    lines += ["", *retrieval_lines]
    write_files(cfg.out, {"kv_token_shift.json": json.dumps(result, indent=1).encode(),
                          "kv_token_shift.md": ("\n".join(lines) + "\n").encode()})
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m benchmarks.kv_token_shift", __doc__.split("\n\n")[0], KVTokenShiftConfig, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
