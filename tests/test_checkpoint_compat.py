"""Checkpoints move both ways: the configs we write read the same in transformers 4.x (the
reference SwiftKV code and many user stacks), and configs in the published checkpoints' form read
the same here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from swiftkv.bundled import ensure_bundled_model
from swiftkv.convert import convert_checkpoint
from tests.tiny import save_tiny_base, tiny_swiftkv_model

TRANSFORMERS4 = Path(__file__).resolve().parents[1] / ".cache" / "transformers4" / "bin" / "python"
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
FIXTURES = Path(__file__).parent / "fixtures"

# transformers 4.x's own reading of a config.json: LlamaConfig keeps rope_theta / rope_scaling and
# ignores keys it does not know (rope_parameters among them).
READ_IN_4X = """
import json, sys
import transformers
from transformers import LlamaConfig
assert transformers.__version__.startswith("4."), transformers.__version__
out = {}
for folder in sys.argv[1:]:
    config = LlamaConfig.from_pretrained(folder)
    out[folder] = {"rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling}
print(json.dumps(out))
"""


def read_in_transformers4(*folders: Path) -> dict[str, dict]:
    assert TRANSFORMERS4.is_file(), f"{TRANSFORMERS4} is missing: run scripts/setup.sh (it installs transformers 4.57)"
    done = subprocess.run([str(TRANSFORMERS4), "-c", READ_IN_4X, *map(str, folders)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def as_4x(rope_parameters: dict) -> dict:
    """What transformers 4.x must see for ``rope_parameters``."""
    scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    plain = scaling.get("rope_type") == "default"
    return {"rope_theta": rope_parameters["rope_theta"],
            "rope_scaling": None if plain else {**scaling, "type": scaling["rope_type"]}}


def test_checkpoints_we_write_read_the_same_in_transformers_4(tmp_path):
    save_tiny_base(tmp_path / "base", "llama", rope_parameters=dict(LLAMA31_ROPE), max_position_embeddings=131072)
    converted = convert_checkpoint(str(tmp_path / "base"), tmp_path / "swiftkv", num_key_value_layers=2)
    ours = AutoConfig.from_pretrained(converted)
    assert ours.rope_parameters == LLAMA31_ROPE
    bundled = ensure_bundled_model()
    seen = read_in_transformers4(converted, bundled)
    assert seen[str(converted)] == as_4x(LLAMA31_ROPE)  # theta 500000 with llama3 scaling, not 10000 plain
    assert seen[str(bundled)] == as_4x(AutoConfig.from_pretrained(bundled).rope_parameters)
    # And saved again by us (as distillation checkpoints are), it still reads back the same here.
    ours.save_pretrained(tmp_path / "again")
    assert AutoConfig.from_pretrained(tmp_path / "again").rope_parameters == LLAMA31_ROPE


@pytest.mark.parametrize("group_size", [1, 2])
def test_configs_in_the_published_form_read_the_same(tmp_path, group_size):
    """The published SwiftKV checkpoints keep RoPE at the top level (transformers 4.x form)."""
    fields = json.loads((FIXTURES / "llama-3.1-8b-instruct-config.json").read_text())
    assert "rope_parameters" not in fields and fields["rope_theta"] == 500000.0
    fields.update(model_type="llama_swiftkv", architectures=["LlamaSwiftKVForCausalLM"], swiftkv=True,
                  num_key_value_layers=16, key_value_group_size=group_size)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "LlamaSwiftKVConfig"
    assert config.rope_parameters == LLAMA31_ROPE
    assert (config.num_key_value_layers, config.key_value_group_size) == (16, group_size)


# Plain transformers, no swiftkv imported, trust_remote_code off (its default).
WITHOUT_SWIFTKV = """
import sys
import transformers
from transformers import AutoConfig
try:
    AutoConfig.from_pretrained(sys.argv[1])
except ValueError as err:
    print("refused:", "llama_swiftkv" in str(err))
if sys.argv[2:]:
    import torch
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(sys.argv[1]).eval()
    torch.save(model(torch.tensor([[3, 1, 4, 1, 5]])).logits, sys.argv[2])
"""


def test_without_swiftkv_the_auto_classes_refuse_and_the_family_class_loads_the_teacher(tmp_path):
    """What a stack without swiftkv does with our checkpoints (documented in docs/model.md): the Auto
    classes do not know ``llama_swiftkv`` (4.x and 5.x); ``LlamaForCausalLM`` loads the base model in
    it, the teacher, and leaves the SwiftKV tensors out."""
    model = tiny_swiftkv_model("llama")
    model.save_pretrained(tmp_path / "swiftkv")
    for python, extra in ((TRANSFORMERS4, []), (sys.executable, [str(tmp_path / "logits.pt")])):
        done = subprocess.run([str(python), "-c", WITHOUT_SWIFTKV, str(tmp_path / "swiftkv"), *extra],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "refused: True" in done.stdout, done.stderr[-3000:]
    teacher = model.swiftkv(False)(torch.tensor([[3, 1, 4, 1, 5]]), use_cache=False).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), teacher)
