#!/usr/bin/env bash
# Deprecated: scripts/gpu_check.py runs every GPU check in one command and one JSON; this runs its
# fsdp_single stage (FSDP2 on one GPU keeps bf16 compute over fp32 master weights, and offload lowers the peak).
#   bash scripts/gpu_check_fsdp_single.sh        (uses .venv/bin/python unless PYTHON is set)
set -euo pipefail
echo "scripts/gpu_check_fsdp_single.sh is deprecated: run python scripts/gpu_check.py (this runs its fsdp_single stage)" >&2
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" scripts/gpu_check.py --stages environment,fsdp_single --out bench/results/gpu_check_fsdp_single.json
