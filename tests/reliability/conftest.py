"""Helpers of the reliability suite (issue 11): real commands as subprocesses, and what they leave.

Every process a run starts inherits ``RELIABILITY_TAG`` from the launcher's environment (the
rollout servers, the router and Megatron's checkpoint-writer helper included), so
:func:`tagged_pids` finds whatever of a run is still alive, wherever it was reparented to.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable, Optional

import pytest

from bench.faults import TAG_ENV, tagged_pids

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "launch/configs/tiny_cpu.yaml"
SFT_CONFIG = "launch/configs/tiny_cpu_sft.yaml"

# A short GSPO run from the seeded initialisation: 2 ranks (EP2), one local server behind the
# router, 4 prompts x 8 samples per step; the servers decode one request at a time
# (rollout.deterministic), so a resumed run samples exactly what an uninterrupted one would.
TINY = ("run.global_batch_size=32", "run.micro_batch_size=8", "run.eval_interval=0",
        "rollout.num_servers=1", "rollout.deterministic=true")


def train_args(run_dir: Path, *settings: str, config: str = CONFIG) -> list[str]:
    args = ["train", "--config", config, "--set", f"run.output_dir={run_dir}"]
    for item in (*TINY, *settings):
        args += ["--set", item]
    return args


def clean_env(**extra: str) -> dict:
    """This environment without what would make a command take itself for a rank."""
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "MEGATRON_GSPO_RANK_LOG_DIR",
            "MEGATRON_GSPO_STATUS_DIR", "MASTER_ADDR", "MASTER_PORT"}
    return dict({k: v for k, v in os.environ.items() if k not in drop}, **extra)


def megatron_gspo(*args: str, timeout: float = 900, env: Optional[dict] = None
                  ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                          env=env or clean_env(), capture_output=True, text=True, timeout=timeout)


class Run:
    """One ``megatron-gspo`` command in the background, in a session of its own, tagged."""

    def __init__(self, args: list[str], log: Path, env: Optional[dict] = None):
        """``env``: the environment instead of :func:`clean_env`'s (a fault's:
        ``bench.faults.Fault.env``); the tag is added to it."""
        self.tag = uuid.uuid4().hex
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "launch.cli", *args], cwd=ROOT,
                                     env=dict(env or clean_env(), **{TAG_ENV: self.tag}),
                                     stdout=self._log,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, \
                f"exited {self.proc.returncode} before {what}:\n{self.output()[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout:.0f} s:\n{self.output()[-4000:]}"
            time.sleep(0.2)

    def wait(self, timeout: float = 600) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self._log.close()
        return code

    def stopped_by(self, send: Callable[[], None], timeout: float = 300) -> tuple[int, list[int]]:
        """``send()`` (a stop signal to some process of the run), then the launcher's exit code
        and the run's processes still alive shortly after it exited (should be none)."""
        send()
        code = self.wait(timeout=timeout)
        return code, wait_gone(self.tag)

    def kill_everything(self) -> None:
        for pid in tagged_pids(self.tag):
            try:
                os.kill(pid, 9)
            except OSError:
                pass


def wait_gone(tag: str, timeout: float = 15) -> list[int]:
    """The processes of ``tag`` still alive after waiting up to ``timeout`` s for them to end."""
    deadline = time.monotonic() + timeout
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def metric_steps(run_dir: Path) -> list[int]:
    """The step of every line of metrics.jsonl, in file order (a repeated step shows twice)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def latest_step(run_dir: Path) -> int:
    marker = run_dir / "checkpoints" / "latest"
    return int(marker.read_text().strip().split("_")[1]) if marker.is_file() else 0


# ------------------------------------------------------------------------------------------------
# A full disk (the checkpoint's and the Hugging Face export's tests)


@pytest.fixture()
def small_disk(tmp_path):
    """(directory, real): a 16 MiB tmpfs where mounting one is permitted (root in this sandbox),
    else a plain directory whose fullness the worker simulates (``real`` False)."""
    target = tmp_path / "disk"
    target.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(target)],
                          capture_output=True, text=True)
    real = proc.returncode == 0
    print(f"full-disk test on {'a real 16 MiB tmpfs' if real else 'a simulated full disk'}"
          + ("" if real else f" (mount: {proc.stderr.strip()})"))
    yield target, real
    if real:
        subprocess.run(["umount", "-l", str(target)], check=False)


def fill_disk(directory: Path, leave: int = 0) -> None:
    """Write a filler file until ``leave`` bytes are free (real ENOSPC from the filesystem)."""
    chunk = b"\0" * (64 << 10)
    with open(directory / "filler", "ab", buffering=0) as f:
        try:
            while shutil.disk_usage(directory).free > leave + len(chunk):
                f.write(chunk)
            while not leave:
                f.write(chunk[:4096])
        except OSError as err:
            assert err.errno == errno.ENOSPC
