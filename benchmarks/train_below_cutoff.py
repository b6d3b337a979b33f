"""Can layers below the cutoff learn to put in the cutoff state what the SwiftKV keys lack?

At c = 15 the keys of layers 17-18 read the token before (written by a previous-token head in layer
16, docs/distillation.md), which one token's cutoff state does not carry. Plain SwiftKV, as vLLM serves
it, could still get there if a layer below the cutoff carried it: this trains the attention
projections of ``--layers`` (below the cutoff; q/k/v unless ``--projections`` says otherwise) beside
the SwiftKV weights, from the recipe's least-squares start,
against a separate frozen teacher; optionally with a loss that matches chosen SwiftKV layers' K/V
(before rotary) to the teacher's own, each normalised by the teacher's variance, for a direct signal
to those lower layers. The result is a SwiftKV checkpoint (its lower layers' own weights changed):
score it with ``ray_jobs.evaluate``.

    python -m benchmarks.train_below_cutoff --cutoff 15 --layers 13 14 --out DIR
    python -m benchmarks.train_below_cutoff --cutoff 15 --out DIR      # the control: SwiftKV weights only
    python -m benchmarks.train_below_cutoff --cutoff 15 --layers 12 13 14 --match 17 18 20 --out DIR
    python -m benchmarks.train_below_cutoff --cutoff 15 --layers 13 14 --projections q k v o --out DIR
    python -m benchmarks.train_below_cutoff --cutoff 15 --layers 13 14 --below-lr 1e-2 --out DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import swiftkv.modeling  # noqa: F401  (registers the SwiftKV classes)
from benchmarks.one_process_distill import distill_in_one_process
from swiftkv.distill.config import DistillConfig, load_config
from swiftkv.distill.model_io import least_squares_once
from swiftkv.model_source import resolve_model

PROJECTIONS = ("q", "k", "v", "o")


class KVMatch:
    """Mean over the chosen layers and K/V of ``|student - teacher|^2 / var(teacher)``, from forward hooks
    on the teacher's ``k/v_proj`` and the student's ``k/v_proj_swiftkv`` (both before rotary)."""

    def __init__(self, teacher, student, layers: list[int]) -> None:
        self.outputs: dict[tuple[str, int, str], torch.Tensor] = {}
        self.keys = [(j, kind) for j in layers for kind in ("k", "v")]
        for j, kind in self.keys:
            self._watch(getattr(teacher.model.layers[j].self_attn, f"{kind}_proj"), ("teacher", j, kind))
            self._watch(getattr(student.model.layers[j].self_attn, f"{kind}_proj_swiftkv"), ("student", j, kind))

    def _watch(self, module, key) -> None:
        module.register_forward_hook(lambda _module, _inputs, output: self.outputs.__setitem__(key, output))

    def __call__(self) -> torch.Tensor:
        errors = [(self.outputs["student", j, kind] - (t := self.outputs["teacher", j, kind])).pow(2).mean() / t.var()
                  for j, kind in self.keys]
        return torch.stack(errors).mean()


def below_cutoff_parameters(model, layers: list[int], projections: tuple[str, ...]) -> list[torch.nn.Parameter]:
    """The weights (and biases, where the family has them) of ``projections`` (``q``, ``k``, ``v``,
    ``o``) in the attention of each of ``layers``."""
    return [p for j in layers for kind in projections
            for p in getattr(model.model.layers[j].self_attn, f"{kind}_proj").parameters()]


def train_below_cutoff(recipe: DistillConfig, layers: list[int], match: list[int], match_weight: float, out: Path,
                       projections: tuple[str, ...] = ("q", "k", "v"), below_lr: float | None = None) -> dict:
    """Writes ``out/model`` and ``out/figures.json`` (returned). ``below_lr``: the peak learning rate of
    the layers below the cutoff (default: the recipe's)."""
    import ray

    from swiftkv.distill.data import build_datasets

    c = recipe.num_key_value_layers
    if layers and max(layers) >= c:
        raise ValueError(f"--layers must be below the cutoff {c}: got {layers}")
    if match and min(match) < c:
        raise ValueError(f"--match names SwiftKV layers (from the cutoff {c} on): got {match}")
    path = resolve_model(recipe.model)
    if not ray.is_initialized():
        ray.init()
    rows, _ = build_datasets(recipe.data, tokenizer_path=path)
    start = least_squares_once(recipe.model, str(out), c, recipe.key_value_group_size,
                               rows.limit(recipe.init.calibration_rows).take_all(), torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    student = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32).train().swiftkv(True)
    student.requires_grad_(False)
    swiftkv = [p for _, p in student.swiftkv_parameters()]
    below = below_cutoff_parameters(student, layers, projections)
    for p in swiftkv + below:
        p.requires_grad_(True)
    kv_match = KVMatch(teacher, student, match) if match else None
    below_lr = recipe.train.lr if below_lr is None else below_lr
    started = time.perf_counter()
    curve = distill_in_one_process(
        recipe, teacher, student,
        [{"params": swiftkv}, {"params": below, "lr": below_lr}] if below else [{"params": swiftkv}],
        f"c={c}, below {layers}",
        extra_loss=(lambda: match_weight * kv_match()) if kv_match else None)
    out.mkdir(parents=True, exist_ok=True)
    student.eval().save_pretrained(out / "model")
    AutoTokenizer.from_pretrained(path).save_pretrained(out / "model")
    figures = {"cutoff": c, "layers_below": layers, "projections": list(projections),
               "below_lr": below_lr, "match": match, "match_weight": match_weight,
               "trainable_below": sum(p.numel() for p in below), "trainable_swiftkv": sum(p.numel() for p in swiftkv),
               "steps": len(curve), "seconds": round(time.perf_counter() - started, 1), "curve": curve}
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="ray_jobs/configs/smollm2-135m-cpu.yaml", help="a distillation recipe")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    parser.add_argument("--cutoff", type=int, required=True, help="SwiftKV's num_key_value_layers")
    parser.add_argument("--layers", type=int, nargs="*", default=[],
                        help="layers below the cutoff to train (none: the plain recipe, the control)")
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, default=["q", "k", "v"],
                        help="which attention projections of --layers to train")
    parser.add_argument("--below-lr", type=float, help="their peak learning rate (default: the recipe's)")
    parser.add_argument("--match", type=int, nargs="*", default=[], help="SwiftKV layers whose K/V to match")
    parser.add_argument("--match-weight", type=float, default=1.0, help="weight of the K/V match beside the KL")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    recipe = load_config(args.recipe, [*args.set, f"num_key_value_layers={args.cutoff}",
                                       f"output.storage_path={args.out}"])
    figures = train_below_cutoff(recipe, args.layers, args.match, args.match_weight, args.out,
                                 tuple(args.projections), args.below_lr)
    print(json.dumps({k: v for k, v in figures.items() if k != "curve"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
