"""Which SwiftKV layers' K/V does needle retrieval need? A diagnosis of a distilled checkpoint.

    python -m benchmarks.retrieval_layers --set model=artifacts/frontier/swiftkv-c15/step_00000060/model

On the evaluation's needle prompts (``swiftkv.evaluation.needle``; the very prompts of a probe with the
same seed and lengths: the longest length sets the filler's span the prompts are drawn from), the
student is scored teacher-forced on the number as the needle probe does, and again with the teacher's
own K/V (each layer's ``k_proj``/``v_proj`` on its own input, as without SwiftKV) put in place of the
SwiftKV K/V of chosen layers: one layer at a time (``layer j``), and the first layers after the cutoff
together (``layers c..k``: the K/V a cutoff at k + 1 keeps exact). Queries and everything else stay the
student's. A layer whose own K/V bring the needle back is one whose keys the cutoff state cannot
carry. ``retrieval_layers.json`` and ``retrieval_layers.md`` land in ``out``. Dense families without
AcrossKV (every layer after the cutoff its own group leader).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

import torch
from pydantic import Field

from swiftkv.evaluation.answer_scoring import score_hidden
from swiftkv.yaml_config import StrictConfig, job_main


class NeedleProbeConfig(StrictConfig):
    """The needle prompts a diagnosis scores (``swiftkv.evaluation.needle``)."""

    lengths: list[int] = Field(default=[512, 2048], min_length=1)
    """Prompt lengths in tokens."""

    depths: list[float] = Field(default=[0.25, 0.75], min_length=1)
    """Needle depths (0 = start of the filler, 1 = its end)."""

    samples: int = Field(default=5, ge=1)
    """Needles per (length, depth); the evaluation's frontier runs used 5."""

    filler: str = "essays"
    """``essays`` or ``squad`` (``swiftkv.evaluation.needle``)."""

    seed: int = 1234
    """The needle probe's seed: the same seed, lengths, depths and samples give the probe's prompts."""


class RetrievalLayersConfig(NeedleProbeConfig):
    model: str
    """A SwiftKV checkpoint folder (a distilled one, e.g. ``<run>/step_*/model``)."""

    out: str = "artifacts/retrieval-layers"
    """Output folder."""


Replacement = Callable[[int, str, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(layer, "k" or "v", the SwiftKV projection's input, the teacher's own K/V) -> the K/V to use``."""


def teachers_own(_layer: int, _kind: str, _swiftkv_input: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """The replacement of this diagnosis: the layer's own K/V, as without SwiftKV."""
    return own


def replacement_variants(c: int, num_layers: int) -> dict[str, list[int]]:
    """Name -> the layers whose SwiftKV K/V are replaced by the teacher's own."""
    variants: dict[str, list[int]] = {"student": []}
    variants |= {f"layer {j}": [j] for j in range(c, num_layers)}
    variants |= {f"layers {c}..{k}": list(range(c, k + 1)) for k in range(c + 1, num_layers)}
    return variants


@torch.inference_mode()
def score_prompt(
    model, prompt: list[int], answer: list[int], variants: dict[str, list[int]],
    replacements: dict[str, Replacement] | None = None,
) -> dict[str, tuple[float, bool]]:
    """``{variant: (answer log-prob, exact)}`` for one needle prompt, and ``base`` (the teacher).

    A variant's layers get their SwiftKV K/V from ``replacements[variant]`` (``teachers_own`` where
    none is given)."""
    replacements = replacements or {}
    decoder, layers = model.get_decoder(), model.get_decoder().layers
    ids = torch.tensor([prompt + answer])
    keep = slice(len(prompt) - 1, None)
    state = decoder(input_ids=ids, swiftkv_layers="to_cutoff", use_cache=False).last_hidden_state
    own: dict[tuple[int, str], torch.Tensor] = {}

    def capture(j: int, kind: str):
        return lambda _m, _i, out: own.__setitem__((j, kind), out)

    def run(student: bool, hooks: list) -> tuple[float, bool]:
        handles = [module.register_forward_hook(fn) for module, fn in hooks]
        try:
            model.swiftkv(student)
            hidden = decoder(inputs_embeds=state, swiftkv_layers="from_cutoff", use_cache=False).last_hidden_state
        finally:
            for h in handles:
                h.remove()
        score = score_hidden(model, hidden[0, keep], answer)
        return score.logprob, score.exact

    c = model.config.num_key_value_layers
    teacher_hooks = [(getattr(layers[j].self_attn, f"{kind}_proj"), capture(j, kind))
                     for j in range(c, len(layers)) for kind in ("k", "v")]
    scores = {"base": run(False, teacher_hooks)}
    for name, replaced in variants.items():
        replace = replacements.get(name, teachers_own)
        hooks = [(getattr(layers[j].self_attn, f"{kind}_proj_swiftkv"),
                  lambda _m, inputs, _o, j=j, kind=kind, replace=replace: replace(j, kind, inputs[0], own[(j, kind)]))
                 for j in replaced for kind in ("k", "v")]
        scores[name] = run(True, hooks)
    return scores


def score_needles(
    model, tokenizer, probe: NeedleProbeConfig, variants: dict[str, list[int]],
    replacements: dict[str, Replacement] | None = None, label: str = "SwiftKV K/V replaced by the layer's own",
) -> tuple[dict, list[str]]:
    """Every variant (and the base) on the probe's needle prompts: ``{variant: {length: {"exact",
    "logprob_vs_base", "n"}}}`` and the same as markdown table lines, ``label`` heading the first column."""
    from tqdm import tqdm

    from swiftkv.evaluation.needle import needle_samples

    lengths = sorted(probe.lengths)
    per_length: dict[int, list[dict[str, tuple[float, bool]]]] = {}
    needles = needle_samples(tokenizer, probe.filler, lengths, probe.depths, probe.samples, probe.seed)
    for length, _depth, prompt, answer in tqdm(needles, total=len(lengths) * len(probe.depths) * probe.samples,
                                               desc="needle prompts", unit="prompt"):
        per_length.setdefault(length, []).append(score_prompt(model, prompt, answer, variants, replacements))
    table = {
        name: {length: {"exact": statistics.fmean(s[name][1] for s in samples),
                        "logprob_vs_base": statistics.fmean(s[name][0] - s["base"][0] for s in samples),
                        "n": len(samples)}
               for length, samples in per_length.items()}
        for name in ["base", *variants]
    }
    head = " | ".join(f"{n} tokens: retrieved, log-prob vs base" for n in lengths)
    lines = [f"| {label} | {head} |", "|---" * (1 + len(lengths)) + "|"]
    for name, cells in table.items():
        row = " | ".join(f"{cells[n]['exact']:.0%} ({cells[n]['logprob_vs_base']:+.1f})" for n in lengths)
        lines.append(f"| {name} | {row} |")
    return table, lines


def run(cfg: RetrievalLayersConfig) -> dict:
    from swiftkv.inference import load_chat_model
    from swiftkv.outputs import write_files

    model, tokenizer = load_chat_model(cfg.model)
    config = model.config
    if not hasattr(model, "swiftkv") or getattr(config, "key_value_group_size", 1) != 1:
        raise ValueError(f"{cfg.model}: a SwiftKV checkpoint without AcrossKV is needed")
    variants = replacement_variants(config.num_key_value_layers, config.num_hidden_layers)
    table, lines = score_needles(model, tokenizer, cfg, variants)
    result = {"model": cfg.model, "cutoff": config.num_key_value_layers, "variants": table}
    write_files(cfg.out, {"retrieval_layers.json": json.dumps(result, indent=1).encode(),
                          "retrieval_layers.md": ("\n".join(lines) + "\n").encode()})
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> int:
    return job_main("python -m benchmarks.retrieval_layers", __doc__.split("\n\n")[0], RetrievalLayersConfig, run,
                    argv)


if __name__ == "__main__":
    raise SystemExit(main())
