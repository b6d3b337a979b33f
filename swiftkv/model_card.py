"""The model card of a distilled SwiftKV checkpoint: ``README.md`` in its folder, as the Hugging Face
hub shows it. The distillation writes it with the recipe that made the checkpoint and its held-out
figures; an evaluation with a quality gate writes the gate's lines into it (between two markers, so
that a later evaluation replaces them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CARD = "README.md"
GATE_START, GATE_END = "<!-- swiftkv:gate -->", "<!-- /swiftkv:gate -->"
NO_GATE = "Not evaluated yet: run `python -m ray_jobs.evaluate` with a `gate` section on this folder."


def card_text(config, recipe: dict[str, Any], figures: dict[str, float]) -> str:
    """The card of a checkpoint with SwiftKV ``config``, distilled by ``recipe`` (the distillation
    config as a dict), with its held-out ``figures``."""
    c, layers, g = config.num_key_value_layers, config.num_hidden_layers, config.key_value_group_size
    base = recipe["model"]
    front = {"library_name": "transformers", "tags": ["swiftkv", "distillation"], "pipeline_tag": "text-generation"}
    if "/" in base and "://" not in base and not base.startswith((".", "/", "~")):
        front["base_model"] = base  # a hub id: the hub links the card to its base
    kl = [f"- held-out KL to the teacher: {figures['heldout_kl_at_start']:.4f} before distillation, "
          f"{figures['heldout_kl']:.4f} after" if "heldout_kl" in figures else "- held-out KL: not measured"]
    if "heldout_top1" in figures:
        kl.append(f"- held-out top-1 agreement: {figures['heldout_top1_at_start']:.3f} before, "
                  f"{figures['heldout_top1']:.3f} after")
    return "\n".join([
        "---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
        f"# {base} with SwiftKV ({100 * (layers - c) // layers}% of the layers skip the prompt)", "",
        f"`{config.model_type}`: prompt tokens stop after layer {c - 1} of {layers}; the KV cache of layers {c} to "
        f"{layers - 1} comes from the hidden state entering layer {c}"
        + (f", one cache per group of {g} layers (AcrossKV)" if g > 1 else "") + ". Decoding keeps every layer. "
        "Load it with `import swiftkv` and `AutoModelForCausalLM.from_pretrained(folder)`, or serve it with vLLM "
        "and the swiftkv plugin installed (`swiftkv serve`).", "",
        f"## Distillation ({figures.get('step', '?')} steps)", "", *kl, "", "The recipe:", "", "```yaml",
        yaml.safe_dump(recipe, sort_keys=False).strip(), "```", "",
        "## Quality gate", "", GATE_START, NO_GATE, GATE_END, "",
    ])


def write_card(folder: str | Path, config, recipe: dict[str, Any], figures: dict[str, float]) -> Path:
    path = Path(folder) / CARD
    path.write_text(card_text(config, recipe, figures))
    return path


def write_gate(folder: str | Path, gate_markdown: str) -> bool:
    """Put the gate's lines into the card of ``folder`` (replacing earlier ones); ``False`` when the
    folder has no card of ours (a base model, a checkpoint made elsewhere), which is left alone."""
    path = Path(folder) / CARD
    text = path.read_text() if path.is_file() else ""
    if GATE_START not in text or GATE_END not in text:
        return False
    before, rest = text.split(GATE_START, 1)
    after = rest.split(GATE_END, 1)[1]
    path.write_text(f"{before}{GATE_START}\n{gate_markdown}\n{GATE_END}{after}")
    return True
