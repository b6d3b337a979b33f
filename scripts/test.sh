#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# Keep caches inside the repo's ignored .cache/ (vLLM, torch extensions, HF), never in $HOME.
export SWIFTKV_CACHE="${SWIFTKV_CACHE:-$PWD/.cache/swiftkv}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
export HF_DATASETS_CACHE="${HF_DATASETS_CACHE:-$PWD/.cache/hf_datasets}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=30 "$@"
