"""Where the tests find the vLLM environment (launch/envs/vllm_cpu.sh builds it, pinned):
``$MGSPO_VLLM_PYTHON`` if set, else ``<repository>/.venv-vllm/bin/python`` once the build's
stamp (``.pins``) is there. Without one, :func:`python` skips the calling test with the command
that builds it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def python() -> Path:
    """The vLLM environment's interpreter (skips the test if there is none)."""
    named = os.environ.get("MGSPO_VLLM_PYTHON")
    if named:
        if not Path(named).is_file():
            pytest.fail(f"MGSPO_VLLM_PYTHON={named}: no such interpreter")
        return Path(named)
    venv = ROOT / ".venv-vllm"
    if not (venv / ".pins").is_file():
        pytest.skip("the vLLM environment is not built (launch/envs/vllm_cpu.sh, or set "
                    "MGSPO_VLLM_PYTHON to its interpreter)")
    return venv / "bin" / "python"
