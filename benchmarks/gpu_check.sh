#!/usr/bin/env bash
# The prepared GPU check for ragkv as vLLM's memory: one script, under 10 minutes on one CUDA GPU.
#   RAGKV_VLLM_PYTHON=/path/to/python-with-cuda-vllm bash benchmarks/gpu_check.sh [OUT.md]
# ragkv's own environment must have torch with CUDA (.venv, or RAGKV_PYTHON). It ingests the
# sample corpus on both engines in bfloat16, measures TTFT from the store against vLLM alone
# with the load's time apart, and the per-layer load against the load before the forward.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${RAGKV_PYTHON:-.venv/bin/python}"
: "${RAGKV_VLLM_PYTHON:?set RAGKV_VLLM_PYTHON to a python with vLLM's CUDA build}"
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device for ragkv')"
"$RAGKV_VLLM_PYTHON" -c "import torch, vllm, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA for vLLM')"
timeout 570 "$python" benchmarks/gpu_check.py --vllm-python "$RAGKV_VLLM_PYTHON" --out "${1:-benchmarks/results/gpu_check.md}"
