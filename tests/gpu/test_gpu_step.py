"""GPU path: Transformer Engine spec, bf16, distributed optimizer, gradient clipping.

Skipped with a reason on machines without CUDA. The CPU counterparts are
tests/distributed/test_layouts.py (every layout, Megatron's own optimizer and clipping) and
tests/unit/test_cpu_compat.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (TE spec, bf16, distributed optimizer)"),
]


def test_gpu_check_script_takes_steps_and_loss_falls():
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "bench" / "gpu_check.py")], cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check: OK" in proc.stdout
    assert "transformer engine spec: True" in proc.stdout
