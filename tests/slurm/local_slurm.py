"""Helpers of the Slurm tests: a handle on the local cluster, submitting the tiny run, metrics."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@dataclass
class LocalSlurm:
    directory: Path
    env: dict
    nodes: list[str]

    def run(self, *cmd: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}")
        return proc

    def states(self, job_id: str) -> list[str]:
        """One state per het-job component (squeue -t all keeps finished jobs)."""
        out = self.run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T", check=False).stdout
        return out.split()

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol -o show job`` of the job (its first component) as a dict."""
        line = self.run("scontrol", "-o", "show", "job", job_id).stdout.splitlines()[0]
        return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)

    def wait(self, job_id: str, timeout: float, until=lambda states: set(states) <= FINAL_STATES,
             what: str = "to finish", log: Path | None = None) -> list[str]:
        deadline = time.monotonic() + timeout
        states: list[str] = []
        while time.monotonic() < deadline:
            states = self.states(job_id)
            if states and until(states):
                return states
            time.sleep(1)
        tail = log.read_text()[-4000:] if log is not None and log.exists() else "(no log)"
        raise AssertionError(f"job {job_id} did not get {what} in {timeout:.0f} s (states "
                             f"{states}); end of its batch log:\n{tail}")


def free_port_block(size: int) -> int:
    """The first port p in 17000..18990 (step 10) with p .. p+size-1 free (slurmctld + slurmds)."""
    for base in range(17000, 19000, 10):
        sockets = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                sockets.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free block of ports for the local Slurm in 17000-18999")


def launch(slurm: LocalSlurm, run_dir: Path, *options: str, env: dict | None = None) -> str:
    """``megatron-gspo launch slurm`` on the tiny CPU config; returns the job id."""
    cmd = [sys.executable, "-m", "launch.cli", "launch", "slurm",
           "--config", "launch/configs/tiny_cpu.yaml", "--set", f"run.output_dir={run_dir}",
           "--nodes", "2", "--rollout-nodes", "1", *options]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(slurm.env, **(env or {})), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"^submitted job (\d+)", proc.stdout, re.M)
    assert match, proc.stdout
    assert f"run dir: {run_dir}" in proc.stdout
    return match.group(1)


def raw_steps(run_dir: Path) -> list[int]:
    """The step of every line of metrics.jsonl, in file order (a repeated step shows twice)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.strip()]
