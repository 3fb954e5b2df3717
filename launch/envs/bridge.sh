#!/usr/bin/env bash
# Builds the pinned Megatron-Bridge environment that the `bridge` test tier runs in
# (.venv-bridge/bin/python -m pytest -m bridge tests/bridge): Python 3.12, torch 2.13.0, megatron-core 0.19.2,
# transformers 5.12.1 and megatron-bridge 0.6.2, with the project installed editable.
#
#   launch/envs/bridge.sh [VENV_DIR]        (default: .venv-bridge in the repository root)
#
# Megatron-Bridge 0.6.2 says Requires-Python >=3.12,<3.13 and pins transformers<=5.12.1; its full
# dependency list pulls GPU-only wheels (flashinfer, fast-hadamard-transform, mamba, wandb, mlflow,
# comet...) that neither build nor run here. So it is installed with --no-deps, beside exactly
# what its import of `megatron.bridge` and the Qwen3-MoE conversion / checkpoint code really import
# (found by importing it until nothing was missing). Transformer Engine is not installed: Bridge's
# one unconditional `import transformer_engine.pytorch` (peft/lora_layers.py) meets a test-only
# stand-in (tests/bridge/bridge_shim.py), which no conversion code touches.
# torch is the registry's build (the CUDA one; it runs on the CPU), as for the 3.12 stack in .ci/run.
# A finished environment is marked with a stamp holding the pins; a second run with the same pins
# returns at once.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-bridge}
PINS="torch==2.13.0 megatron-core==0.19.2 transformers==5.12.1 megatron-bridge==0.6.2"
# what megatron.bridge imports for Qwen3-MoE conversion and checkpoints (its own list is GPU-wide)
BRIDGE_IMPORTS="einops==0.8.2 omegaconf==2.3.0 hydra-core==1.3.8 rich accelerate==1.15.0 regex requests
datasets==5.2.0 tensorboard nvidia-modelopt==0.47.0 megatron-energon==7.4.1 pyyaml tqdm six typing-extensions"
# the project's own dependencies (pyproject.toml) that torch / megatron-core / transformers do not bring
PROJECT_DEPS="safetensors numpy psutil math-verify aiohttp matplotlib pytest pytest-timeout"
STAMP="$PINS | $BRIDGE_IMPORTS | $PROJECT_DEPS"
if [ -f "$VENV/.pins" ] && [ "$(cat "$VENV/.pins")" = "$STAMP" ]; then
    echo "bridge.sh: $VENV is ready ($PINS)"
    exit 0
fi
# python3.12 on PATH may be a pyenv shim that refuses to run (exit 127): every candidate is run
PY=""
for candidate in "${BRIDGE_ENV_PYTHON:-}" "$(command -v python3.12 || true)" ~/.pyenv/versions/3.12*/bin/python3.12 \
        /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] \
            && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY=$candidate
        break
    fi
done
if [ -z "$PY" ]; then
    echo "bridge.sh: no working Python 3.12 interpreter (python3.12, ~/.pyenv/versions/3.12*): Megatron-Bridge 0.6.2 needs 3.12" >&2
    exit 1
fi
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q torch==2.13.0 megatron-core==0.19.2 transformers==5.12.1 $BRIDGE_IMPORTS $PROJECT_DEPS
"$VENV/bin/pip" install -q --no-deps megatron-bridge==0.6.2
"$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c 'import megatron.core, transformers, torch; from importlib.metadata import version; print("megatron-bridge", version("megatron-bridge"), "megatron-core", megatron.core.__version__, "transformers", transformers.__version__, "torch", torch.__version__)'
echo "$STAMP" > "$VENV/.pins"
