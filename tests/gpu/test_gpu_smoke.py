"""bench/gpu_smoke.py: every check runs on CPU / gloo here (``--device cpu``), and on a CUDA GPU
with NCCL where there is one.

The CPU run covers every code path of the script except what only a GPU has: bf16 weights with
Megatron's distributed optimizer (CPU: float32, the plain optimizer), NCCL, and CUDA kernels'
determinism. The GPU test is skipped, with that reason, on machines without CUDA.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_smoke.py"
CHECKS = ["environment", "sft_bf16_distributed_optimizer", "rl_train_rollout",
          "checkpoint_exact_resume", "converted_checkpoint", "train_command"]


def _run(device: str, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", device], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _verdicts(stdout: str) -> dict[str, str]:
    return {line.split()[1]: line.split()[0] for line in stdout.splitlines()
            if line.startswith(("PASS ", "FAIL "))}


@pytest.mark.slow
def test_every_check_passes_on_cpu():
    proc = _run("cpu", timeout=1500)
    assert _verdicts(proc.stdout) == {name: "PASS" for name in CHECKS}, proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0
    assert proc.stdout.strip().splitlines()[-1] == f"gpu_smoke: {len(CHECKS)}/{len(CHECKS)} checks passed on cpu"


def test_lists_missing_dependencies_and_installs_only_from_its_wheel_directory(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_smoke
    finally:
        sys.path.pop(0)
    assert gpu_smoke.missing_modules() == []  # this environment has every dependency
    assert gpu_smoke.install_missing(tmp_path / "none") == []  # nothing to install: no pip call
    out = subprocess.run([sys.executable, str(SCRIPT), "--list-missing"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "(nothing missing)"
    assert gpu_smoke.DEPENDENCIES["megatron.core"] == "megatron-core==0.16.1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL, bf16, the "
                                                          "distributed optimizer)")
def test_every_check_passes_on_the_gpu():
    proc = _run("cuda", timeout=900)
    assert _verdicts(proc.stdout) == {name: "PASS" for name in CHECKS}, proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0
