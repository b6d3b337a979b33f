"""Per-replica figures the simulator runs on: a profile file, as ``swiftkv calibrate`` writes it
(measured on the machine it runs on) or derived from published figures, one entry per model variant.

A variant's figures: uncached prefill tokens/s at several prompt lengths, decode step time at
several batch sizes (short context) and at several context lengths (one batch size), the engine's
token budget per step, its sequence cap, its KV-cache capacity in tokens and its start-up time.
:class:`ReplicaCosts` turns them into the two functions the replica model needs.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from pydantic import Field, model_validator

from swiftkv.yaml_config import StrictConfig, parse_config


class ModelFigures(StrictConfig):
    """One model variant on one kind of replica (the ``models.<name>`` entry of a profile)."""

    model: str
    """The model reference measured (or the model the figures were derived for)."""

    hardware: str
    """What one replica runs on."""

    prefill_skipping: bool = True
    """SwiftKV prefill skipping as measured (no effect on base models)."""

    prefill_tokens_per_s: float = Field(gt=0)
    """The capacity figure replicas publish and the policy and router use (``prefill_tokens_per_s``
    of the serve config): calibrated at the longest prompt length."""

    prefill_tokens_per_s_by_input_len: dict[int, float] = Field(min_length=1)
    """Uncached prompt tokens/s when prompts of this many tokens are prefilled (linear in between,
    constant beyond the ends)."""

    decode_step_s_by_batch: dict[int, float] = Field(min_length=1)
    """Seconds per decode step of this many sequences, each with ``decode_context_tokens`` of context."""

    decode_context_tokens: int = Field(default=128, gt=0)
    """The context length of the ``decode_step_s_by_batch`` points."""

    decode_step_s_by_context: dict[int, float] = {}
    """Seconds per decode step of ``decode_context_batch`` sequences with this many tokens of context
    each (how KV reads grow the step)."""

    decode_context_batch: int = Field(default=1, gt=0)
    """The batch size of the ``decode_step_s_by_context`` points."""

    kv_cache_tokens: int = Field(gt=0)
    """Tokens of KV cache one replica holds (vLLM's blocks x block size)."""

    max_num_batched_tokens: int = Field(gt=0)
    """The engine's token budget per step (decode tokens first, prefill chunks fill the rest)."""

    max_num_seqs: int = Field(gt=0)
    """Most sequences the engine runs at once."""

    startup_s: float = Field(ge=0)
    """Seconds from asking for a replica to its first request."""

    num_prompts: int | None = None
    """Prompts per prefill measurement (measured profiles)."""

    rounds: int | None = None
    """Repetitions, medians reported (measured profiles)."""

    measured_at: str | None = None
    """When (measured profiles)."""

    timed_unix: tuple[float, float] | None = None
    """Wall-clock seconds (Unix) between which the timed measurements ran, after the warm-up (the
    first copy's, side by side): to set beside a record of the host's CPUs."""

    side_by_side: int = Field(default=1, gt=0)
    """Copies of the replica measured at once on one host (``swiftkv calibrate --side-by-side``;
    the medians): the figures of one replica among that many sharing the host."""

    notes: str = ""
    """How the figures were obtained, when not by ``swiftkv calibrate``."""

    @model_validator(mode="after")
    def _positive(self) -> ModelFigures:
        for name in ("prefill_tokens_per_s_by_input_len", "decode_step_s_by_batch", "decode_step_s_by_context"):
            bad = [k for k, v in getattr(self, name).items() if k <= 0 or v <= 0]
            if bad:
                raise ValueError(f"{name}: keys and values must be positive (bad: {bad})")
        return self


class Profile(StrictConfig):
    """A profile file: per-replica figures of each model variant."""

    source: str = ""
    """Where the figures come from (the command that measured them, or the derivation)."""

    models: dict[str, ModelFigures] = Field(min_length=1)
    """Figures by variant name (the names a fleet config refers to)."""

    def figures(self, name: str) -> ModelFigures:
        if name not in self.models:
            raise ValueError(f"the profile has no model {name!r} (it has {', '.join(sorted(self.models))})")
        return self.models[name]


def load_profile(path: str | Path) -> Profile:
    """Read a profile (JSON, as ``swiftkv calibrate`` writes it, or YAML); errors name the bad key."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text())  # JSON is YAML
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not YAML or JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ValueError(f"{path}: a profile is a mapping with a 'models' key")
    return parse_config(Profile, tree, what=f"profile {path}")


def profile_json(profile: Profile) -> str:
    """The file's text (defaults left out)."""
    return json.dumps(profile.model_dump(mode="json", exclude_defaults=True), indent=2) + "\n"


def save_profile(profile: Profile, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile_json(profile))


@dataclass(frozen=True)
class ReplicaCosts:
    """The cost functions of one replica, from its figures."""

    lengths: tuple[int, ...]
    rates: tuple[float, ...]
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float

    @classmethod
    def from_figures(cls, figures: ModelFigures) -> ReplicaCosts:
        lengths = tuple(sorted(figures.prefill_tokens_per_s_by_input_len))
        rates = tuple(figures.prefill_tokens_per_s_by_input_len[n] for n in lengths)
        # Decode step = a + b * batch + c * (context tokens of the whole batch): fixed work (weights),
        # per-sequence work, and KV reads. Least squares over every measured point, none negative.
        rows = [(1.0, b, b * figures.decode_context_tokens, s) for b, s in figures.decode_step_s_by_batch.items()]
        rows += [(1.0, figures.decode_context_batch, figures.decode_context_batch * ctx, s)
                 for ctx, s in figures.decode_step_s_by_context.items()]
        a, b, c = _nonnegative_fit(np.array([r[:3] for r in rows]), np.array([r[3] for r in rows]))
        return cls(lengths, rates, a, b, c)

    def prefill_rate(self, prompt_tokens: float) -> float:
        """Uncached prompt tokens/s while prompts of this length are prefilled."""
        lengths, rates = self.lengths, self.rates
        if prompt_tokens <= lengths[0]:
            return rates[0]
        if prompt_tokens >= lengths[-1]:
            return rates[-1]
        i = bisect.bisect_right(lengths, prompt_tokens)
        share = (prompt_tokens - lengths[i - 1]) / (lengths[i] - lengths[i - 1])
        return rates[i - 1] + share * (rates[i] - rates[i - 1])

    def idle_ttft_s(self, prompt_tokens: float) -> float:
        """A prompt's prefill time alone on an idle replica: its best possible TTFT."""
        return prompt_tokens / self.prefill_rate(prompt_tokens)

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        """Seconds of one decode step of ``batch`` sequences holding ``context_tokens`` in all."""
        if batch <= 0:
            return 0.0
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_per_context_token_s * context_tokens


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Least squares ``x @ coef ~ y`` (columns: 1, batch, context tokens) with coefficients >= 0.
    A term the points cannot tell apart (one batch size; one context length per sequence) is left
    out, and so is one that comes out negative (the rest refit)."""
    active = [0]
    if len(set(x[:, 1])) > 1:
        active.append(1)
    if len(set(x[:, 2] / x[:, 1])) > 1:
        active.append(2)
    while True:
        coef = np.zeros(3)
        coef[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return float(coef[0]), float(coef[1]), float(coef[2])
        active.remove(min(negative, key=lambda i: coef[i]))
