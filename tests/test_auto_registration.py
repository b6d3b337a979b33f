"""``import swiftkv`` then ``AutoModelForCausalLM.from_pretrained(a SwiftKV checkpoint)`` works in a
fresh interpreter, whichever of swiftkv and transformers is imported first, while ``import swiftkv``
alone imports neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tiny import tiny_swiftkv_model

LOAD = "print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__, " \
       "type(AutoConfig.from_pretrained(sys.argv[1])).__name__)"


def fresh_python(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_importing_the_package_stays_light():
    assert fresh_python("import sys, swiftkv; print(sorted({'torch', 'transformers'} & set(sys.modules)))") == "[]"


@pytest.mark.parametrize("imports", [
    "import sys, swiftkv\nfrom transformers import AutoConfig, AutoModelForCausalLM",
    "import sys\nfrom transformers import AutoConfig, AutoModelForCausalLM\nimport swiftkv",
    # transformers loads its Auto classes' module half-way through another import here
    "import sys, swiftkv\nfrom transformers import LlamaForCausalLM\n"
    "from transformers import AutoConfig, AutoModelForCausalLM",
], ids=["swiftkv first", "transformers first", "a model class first"])
def test_import_swiftkv_then_from_pretrained_in_a_fresh_interpreter(tmp_path, imports):
    tiny_swiftkv_model("llama").save_pretrained(tmp_path)
    assert fresh_python(f"{imports}\n{LOAD}", str(tmp_path)) == "LlamaSwiftKVForCausalLM LlamaSwiftKVConfig"
