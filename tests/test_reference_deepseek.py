"""Our DeepSeek-V2 SwiftKV classes against the reference training code's (snowflakedb/ArcticTraining,
``projects/swiftkv/models/deepseek_v2``: its SwiftKV classes on its own copy of DeepSeek's
remote-code model, written for transformers 4.x). On one checkpoint both give the same student and
teacher logits, and a checkpoint written by either loads in the other.

The reference runs in the transformers 4.57 environment ``scripts/setup.sh`` builds
(``.cache/transformers4``), with torch borrowed from this venv (appended to its path, so its own
transformers wins). Its code is not shipped here: point ``SWIFTKV_ARCTIC_TRAINING`` at a checkout
(``git clone https://github.com/snowflakedb/ArcticTraining``). Skips, saying what is missing,
without one of the two."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from swiftkv.modeling import DeepseekV2SwiftKVForCausalLM
from tests.tiny import randomize_swiftkv_weights, tiny_config

TRANSFORMERS4 = Path(__file__).resolve().parents[1] / ".cache" / "transformers4" / "bin" / "python"
REFERENCE = os.environ.get("SWIFTKV_ARCTIC_TRAINING", "")
MODELS_DIR = Path(REFERENCE) / "projects" / "swiftkv" / "models"
# DeepSeek-V2-Lite's YaRN RoPE (factor 40 over 4,096 positions; mscale 0.707 on every dimension,
# which also scales the softmax), so the comparison covers the real models' rotary path.
LITE_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}

pytestmark = [
    pytest.mark.skipif(not REFERENCE, reason="set SWIFTKV_ARCTIC_TRAINING to an ArcticTraining checkout"),
    pytest.mark.skipif(bool(REFERENCE) and not (MODELS_DIR / "deepseek_v2").is_dir(),
                       reason=f"{MODELS_DIR / 'deepseek_v2'} is missing: not an ArcticTraining checkout"),
    pytest.mark.skipif(not TRANSFORMERS4.is_file(), reason=f"{TRANSFORMERS4} is missing: run scripts/setup.sh"),
]

# Run by the transformers 4.x python. argv: site-packages to borrow torch from, the reference's
# models folder, a JSON task. Writes the reference's student and teacher logits.
REFERENCE_SIDE = """
import json, sys
sys.path.append(sys.argv[1])
sys.path.insert(0, sys.argv[2])
task = json.loads(sys.argv[3])
import torch, transformers
assert transformers.__version__.startswith("4."), transformers.__version__
from deepseek_v2 import DeepseekV2SwiftKVConfig, DeepseekV2SwiftKVForCausalLM

if task["write"]:  # a fresh reference model with random SwiftKV weights, saved as the reference saves
    torch.manual_seed(0)
    config = DeepseekV2SwiftKVConfig(**task["config"])
    model = DeepseekV2SwiftKVForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "swiftkv" in name:
                noise = torch.randn(param.shape, generator=gen)
                param.copy_(1.0 + 0.2 * noise if "norm_swiftkv" in name else 0.08 * noise)
    model.save_pretrained(task["folder"])
else:
    model, info = DeepseekV2SwiftKVForCausalLM.from_pretrained(
        task["folder"], torch_dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    missing = info["missing_keys"] + info["unexpected_keys"] + info["mismatched_keys"]
    assert not missing, f"our checkpoint does not match the reference's tensors: {missing}"
    model.eval()
ids = torch.tensor(task["ids"])
logits = {}
with torch.no_grad():
    for mode in ("student", "teacher"):
        model.swiftkv(mode == "student")
        logits[mode] = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
torch.save(logits, task["logits"])
"""


def run_reference(task: dict) -> dict[str, torch.Tensor]:
    site = sysconfig.get_paths()["purelib"]
    done = subprocess.run([str(TRANSFORMERS4), "-c", REFERENCE_SIDE, site, str(MODELS_DIR), json.dumps(task)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(task["logits"])


def our_logits(model: DeepseekV2SwiftKVForCausalLM, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Full forwards without a cache: the student's (every layer on every token) and the teacher's."""
    out = {}
    with torch.no_grad():
        for mode in ("student", "teacher"):
            model.swiftkv(mode == "student")
            out[mode] = model(input_ids=ids, use_cache=False).logits
    return out


def assert_same_logits(ours: dict, reference: dict) -> None:
    for mode in ("student", "teacher"):
        gap = (ours[mode] - reference[mode]).abs().max().item()
        print(f"{mode}: largest logit gap to the reference {gap:.2e}")
        assert gap < 1e-4, f"{mode} logits differ from the reference's by {gap}"
    # The SwiftKV weights matter on this checkpoint, so equal students are not equal by accident.
    assert (ours["student"] - ours["teacher"]).abs().max().item() > 1e-2


VARIANTS = {
    # DeepSeek-V2-Lite's form (no query LoRA), YaRN RoPE, AcrossKV off.
    "lite-yarn": {"q_lora_rank": None, "key_value_group_size": 1, "rope_parameters": LITE_YARN,
                  "max_position_embeddings": 163840},
    # DeepSeek-V2's form (query LoRA), plain RoPE, 2-way AcrossKV.
    "q_lora-acrosskv2": {"q_lora_rank": 24, "key_value_group_size": 2},
}


def tiny(variant: str):
    return tiny_config("deepseek_v2", num_hidden_layers=6, num_key_value_layers=2, initializer_range=0.1,
                       **VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_our_checkpoint_gives_the_reference_logits(variant, tmp_path):
    torch.manual_seed(0)
    model = DeepseekV2SwiftKVForCausalLM(tiny(variant)).eval()
    randomize_swiftkv_weights(model, seed=1)
    model.save_pretrained(tmp_path / "ours")
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(5))
    reference = run_reference({"write": False, "folder": str(tmp_path / "ours"), "ids": ids.tolist(),
                               "logits": str(tmp_path / "reference.pt")})
    assert_same_logits(our_logits(model, ids), reference)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_checkpoint_loads_here_with_its_logits(variant, tmp_path):
    config = tiny(variant).to_dict()  # as saved: RoPE also in the 4.x form the reference reads
    fields = {k: v for k, v in config.items() if k not in {"transformers_version", "architectures", "model_type",
                                                           "rope_parameters", "dtype"}}
    ids = torch.randint(3, 1000, (2, 24), generator=torch.Generator().manual_seed(6))
    reference = run_reference({"write": True, "config": fields, "folder": str(tmp_path / "reference"),
                               "ids": ids.tolist(), "logits": str(tmp_path / "reference.pt")})
    model, info = DeepseekV2SwiftKVForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32,
                                                               output_loading_info=True)
    assert not any(info.values()), info
    assert_same_logits(our_logits(model.eval(), ids), reference)
