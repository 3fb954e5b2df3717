"""Shared e2e fixture: one cold-start SFT policy (Hugging Face directory) for the GSPO tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SFT_STEPS = 450  # as launch/configs/tiny_cpu_sft.yaml: about 18% held-out exact match


def megatron_gspo(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"megatron-gspo {' '.join(args)} exited {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


@pytest.fixture(scope="session")
def sft_policy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    megatron_gspo("sft", "--config", "launch/configs/tiny_cpu_sft.yaml",
                  "--set", f"run.output_dir={out}", "--set", f"run.num_steps={SFT_STEPS}",
                  "--set", "run.eval_interval=0", "--set", "run.log_interval=100")
    assert (out / "hf" / "config.json").is_file() and (out / "hf" / "tokenizer.json").is_file()
    return out / "hf"
