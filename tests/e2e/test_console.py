"""What a user sees: real commands as subprocesses, their console, their rank and server logs.

* ``megatron-gspo sft`` with 2 local ranks: the console carries rank 0's output and no third-party
  warning; rank 1's output is in ``RUN_DIR/logs/rank1.log``; ``MEGATRON_GSPO_SHOW_WARNINGS=1``
  brings Megatron's warnings back, rank 0's on the console and rank 1's in its log only.
* the local rollout servers behind the real sglang-router (``pipeline/servers/cluster.py``): the router's
  connection probe leaves no "Invalid HTTP request" line in a server's log, unless the switch is on;
  a server started from inside a training rank is not taken for a rank.
* a rank that fails: its traceback (or its one-line error) still reaches the console.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.observe.benign_warnings import SHOW_ENV
from launch.local import RANK_LOG_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# Python's warning format, "<file>:<line>: <Category>: <message>", and torch / uvicorn log warnings
WARNING_LINE = re.compile(r"^\S+:\d+: \w*Warning: |^WARNING: |^W\d{4} ", re.M)
MEGATRON_NOTICE = "UserWarning: Apex is not installed. Falling back to Torch Norm"


def clean_env(**extra: str) -> dict:
    drop = {SHOW_ENV, RANK_LOG_DIR_ENV, "RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID"}
    return dict({k: v for k, v in os.environ.items() if k not in drop}, **extra)


def sft_two_ranks(run_dir: Path, env: dict) -> subprocess.CompletedProcess:
    args = ["sft", "--config", "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={run_dir}",
            "--set", "run.num_steps=2", "--set", "run.eval_interval=0", "--set", "run.log_interval=1",
            "--nproc", "2"]
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_two_rank_sft_console_is_rank_0_without_third_party_warnings(tmp_path):
    run_dir = tmp_path / "quiet"
    proc = sft_two_ranks(run_dir, clean_env())
    console = proc.stdout + proc.stderr
    assert WARNING_LINE.findall(console) == [], console
    assert "step 2/2" in proc.stdout and "layout: world 2" in proc.stdout
    assert f"rank 1 logs to {run_dir.resolve() / 'logs'}" in proc.stdout
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    assert rank1.startswith("==== ") and "rank 1 (pid " in rank1 and " sft --config " in rank1
    assert WARNING_LINE.findall(rank1) == [], rank1

    # the switch: every process shows Megatron's notices again; rank 1's stay in its log
    run_dir = tmp_path / "loud"
    proc = sft_two_ranks(run_dir, clean_env(**{SHOW_ENV: "1"}))
    console = proc.stdout + proc.stderr
    rank1 = (run_dir / "logs" / "rank1.log").read_text()
    on_console, in_log = console.count(MEGATRON_NOTICE), rank1.count(MEGATRON_NOTICE)
    assert on_console > 0 and in_log == on_console, (on_console, in_log, console[-3000:])
    assert "[rank1]" not in console and "rank 1" not in console.replace("rank 1 logs to", "")


def test_servers_behind_the_router_log_no_benign_warning(tmp_path, monkeypatch):
    from pipeline.servers.cluster import LocalRolloutCluster
    from tests.rollout.tiny import make_model_dir

    model = make_model_dir(tmp_path / "model")
    # as if started by training rank 1 of a local run: the server must not take itself for it
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(RANK_LOG_DIR_ENV, str(tmp_path / "rank_logs"))
    for show in (False, True):
        if show:
            monkeypatch.setenv(SHOW_ENV, "1")
        else:
            monkeypatch.delenv(SHOW_ENV, raising=False)
        log_dir = tmp_path / f"logs_{show}"
        with LocalRolloutCluster(model, num_servers=1, log_dir=log_dir) as cluster:
            assert cluster.router_worker_urls() == cluster.server_urls
        server_log = (log_dir / "server0.log").read_text()
        probe_lines = server_log.count("Invalid HTTP request received.")
        if show:
            assert probe_lines > 0, server_log  # the router's gRPC probe: the check below means something
        else:
            assert probe_lines == 0 and WARNING_LINE.findall(server_log) == [], server_log
    assert not (tmp_path / "rank_logs").exists()


def test_a_failing_rank_shows_its_traceback_and_errors_on_the_console(tmp_path):
    """``launch.cli`` in a rank whose output goes to its log (what ensure_ranks sets up for ranks 1..)."""
    logs = tmp_path / "logs"
    env = clean_env(RANK="1", WORLD_SIZE="2", **{RANK_LOG_DIR_ENV: str(logs)})
    broken = tmp_path / "broken_model"  # passes serve's argument checks, then fails to load
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": "x"}')
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "serve", "--model-path", str(broken)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    log = (logs / "rank1.log").read_text()
    assert f"[rank 1] failed; full log: {logs / 'rank1.log'}" in proc.stderr
    for text in (proc.stderr, log):
        assert "Traceback (most recent call last)" in text
        assert "Field 'hidden_size' expected int, got str" in text

    # a configuration error: its one line on the console as well
    bad = tmp_path / "bad.yaml"
    bad.write_text("parallel:\n  expert: 3\n")
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "config", "--config", str(bad)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert re.search(r"^\[rank 1\] megatron-gspo config: configuration error: .*parallel\.expert: 3",
                     proc.stderr, re.M), proc.stderr
    assert "configuration error" in (logs / "rank1.log").read_text()
