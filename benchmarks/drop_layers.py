"""The baseline SwiftKV has to beat at the same prefill saving: drop the last ``L - c`` layers for
every token (prompt and decode alike) and heal the shortened model by distillation from the whole one
on the same data, steps and learning rate as SwiftKV's recipe.

The healed weights are the last kept layers, all of them (attention, MLP, norms) and the final norm:
as many whole layers as it takes to train at least as many weights as SwiftKV trains at that cutoff,
so the baseline never has the smaller budget. They train as ``benchmarks.one_process_distill`` does
(the recipe's rows, KL and schedule, one process). The result is a plain checkpoint of the base's
family with ``c`` layers.

    python -m benchmarks.drop_layers --recipe ray_jobs/configs/smollm2-135m-cpu.yaml --cutoff 15 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.one_process_distill import distill_in_one_process
from swiftkv.analysis.flops import swiftkv_param_count
from swiftkv.distill.config import DistillConfig, load_config
from swiftkv.model_source import resolve_model


def shortened(base, keep: int):
    """A copy of ``base`` with its first ``keep`` layers, embeddings, final norm and head."""
    config = base.config.__class__.from_dict({**base.config.to_dict(), "num_hidden_layers": keep})
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:keep]
    model = AutoModelForCausalLM.from_config(config)
    state = {k: v.clone() for k, v in base.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep}
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model


def healed_layers(base, cutoff: int) -> int:
    """Whole last layers to train so that at least SwiftKV's trainable weight count at ``cutoff`` trains."""
    swiftkv, _ = swiftkv_param_count(base.config, cutoff, 1)
    per_layer = sum(p.numel() for p in base.model.layers[0].parameters())
    return min(cutoff, max(1, math.ceil(swiftkv / per_layer)))


def train_drop_baseline(recipe: DistillConfig, cutoff: int, out: Path) -> dict:
    """Heal the base of ``recipe`` shortened to ``cutoff`` layers; writes ``out/model`` and
    ``out/figures.json`` (returned)."""
    path = resolve_model(recipe.model)
    teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    student = shortened(teacher, cutoff).train()
    student.requires_grad_(False)
    heal = healed_layers(teacher, cutoff)
    trainable = [p for layer in student.model.layers[cutoff - heal:] for p in layer.parameters()]
    trainable += list(student.model.norm.parameters())
    for p in trainable:
        p.requires_grad_(True)
    started = time.perf_counter()
    curve = distill_in_one_process(recipe, teacher, student, [{"params": trainable}], f"drop c={cutoff}")
    out.mkdir(parents=True, exist_ok=True)
    student.eval().save_pretrained(out / "model")
    AutoTokenizer.from_pretrained(path).save_pretrained(out / "model")
    figures = {"cutoff": cutoff, "layers": cutoff, "healed_layers": heal,
               "trainable_params": sum(p.numel() for p in trainable),
               "swiftkv_trainable_params": swiftkv_param_count(teacher.config, cutoff, 1)[0],
               "steps": len(curve), "seconds": round(time.perf_counter() - started, 1), "curve": curve}
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True, help="a distillation recipe (ray_jobs/configs/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe overrides")
    parser.add_argument("--cutoff", type=int, required=True, help="layers kept (SwiftKV's num_key_value_layers)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    recipe = load_config(args.recipe, [*args.set, f"output.storage_path={args.out}"])
    print(json.dumps({k: v for k, v in train_drop_baseline(recipe, args.cutoff, args.out).items() if k != "curve"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
