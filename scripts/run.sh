#!/usr/bin/env bash
# Set up (idempotent) and run the main job end to end on its embedded default: a local Ray cluster,
# the bundled SmolLM2-135M-Instruct and the bundled chat and benchmark data. Extra arguments go to
# the job, e.g. `bash scripts/run.sh --set quick=true` (every step at a reduced size).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export SWIFTKV_CACHE="${SWIFTKV_CACHE:-$PWD/.cache/swiftkv}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$PWD/.cache/vllm}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"
export HF_DATASETS_CACHE="${HF_DATASETS_CACHE:-$PWD/.cache/hf_datasets}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m ray_jobs.main "$@"
