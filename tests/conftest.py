"""Fixtures shared by several test directories.

``sft_policy``: one cold-start SFT policy (a Hugging Face directory) per session, the starting point
of every GSPO run in the tests (tests/e2e, tests/slurm). About 90 s on a busy 2-core CPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    # The registry's warnings that are benign only without CUDA (pyproject.toml lists the others):
    # on a GPU machine a missing Transformer Engine shows in the summary (launch/benign_warnings.py).
    from launch import benign_warnings

    if not benign_warnings.showing_everything() and not benign_warnings.cuda_machine():
        for line in benign_warnings.pytest_filters(only_without_cuda=True):
            config.addinivalue_line("filterwarnings", line)


@pytest.fixture(scope="session")
def sft_policy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    # the config's own number of steps (the demo's SFT policy)
    args = ["sft", "--config", "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={out}",
            "--set", "run.eval_interval=0", "--set", "run.log_interval=100"]
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (f"megatron-gspo {' '.join(args)} exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    return out / "hf"
