"""Helpers of the e2e tests (the shared ``sft_policy`` fixture is in tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def megatron_gspo(*args: str, timeout: float = 600, check: bool = True,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"megatron-gspo {' '.join(args)} exited {proc.returncode}\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


CONFIG = "launch/configs/tiny_cpu.yaml"
# The uninterrupted 6-step EP2 run (padded rows, bit-exact deterministic rollouts) that both
# test_gspo_run.py's kill -9 test and test_gspo_context_parallel.py compare against.
EP2_REFERENCE = ("run.num_steps=6", "run.save_interval=2", "run.eval_interval=0",
                 "run.global_batch_size=64", "rollout.deterministic=true")


def train_args(run_dir: Path, init: Path, *extra: str) -> list[str]:
    args = ["train", "--config", CONFIG, "--set", f"run.output_dir={run_dir}",
            "--set", f"run.init_from={init}"]
    for item in extra:
        args += ["--set", item]
    return args


@pytest.fixture(scope="session")
def ep2_reference(sft_policy, tmp_path_factory) -> Path:
    """The run directory of ``EP2_REFERENCE`` from the session's SFT policy (run once)."""
    run_dir = tmp_path_factory.mktemp("ep2_reference") / "run"
    megatron_gspo(*train_args(run_dir, sft_policy, *EP2_REFERENCE), timeout=900)
    return run_dir


def hf_weights(hf_dir: Path) -> dict:
    """Every tensor of a Hugging Face directory's safetensors shards (a run's ``RUN_DIR/hf``
    export, the SFT policy): name -> tensor."""
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def kill_rank_after_checkpoint(args: list[str], run_dir: Path, log_path: Path, *,
                               step: int = 2, rank: int = 1) -> int:
    """Start ``megatron-gspo *args``, SIGKILL training rank ``rank`` once the checkpoint of
    ``step`` is the latest, and return the launcher's exit status (its output in ``log_path``)."""
    latest = run_dir / "checkpoints" / "latest"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 600
        while not (latest.is_file() and latest.read_text().strip() == f"step_{step:06d}"):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no checkpoint at step {step}"
            time.sleep(0.2)
        os.kill(int((run_dir / "pids" / f"rank{rank}.pid").read_text()), signal.SIGKILL)
        proc.wait(timeout=300)
    return proc.returncode
