"""``RLSession`` releases everything it started when the loop fails half-way.

A real GSPO session (``launch.rl_session.run_training``: one rank, embedded mode, one local
rollout server behind the real sglang-router) whose reward function raises at the first step. In
the same process, right after the call returns and before the interpreter exits (so before any
``atexit`` safety net), the driver checks that the error names the step and that the session has
released what it held: no server or router process left, torch.distributed torn down, SIGTERM
back to its default handler.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pipeline.servers.cluster import free_port
from tests.e2e.conftest import ROOT

CONFIG = "launch/configs/tiny_cpu.yaml"

DRIVER = r'''
import json, os, signal, sys
from pathlib import Path

import torch.distributed as dist

from launch.rl_session import run_training
from megatron_gspo.config import load_config
from megatron_gspo.errors import one_line

cfg = load_config(sys.argv[1], sys.argv[2:])
import pipeline.servers.pool as server_pool
built = {}
real_init = server_pool.ServerPool.__init__

def recording_init(self, *args, **kwargs):  # what the session configured its pool with
    real_init(self, *args, **kwargs)
    built["outage_timeout_s"] = self.outage_timeout_s

server_pool.ServerPool.__init__ = recording_init
try:
    run_training(cfg, resume=False)
    error = None
except Exception as err:  # the loop's error, after the session's ExitStack has run
    error = one_line(err)
alive = []
for entry in Path("/proc").iterdir():
    if entry.name.isdigit() and int(entry.name) != os.getpid():
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cfg.run.output_dir in cmdline:
            alive.append(f"{entry.name}: {cmdline}")
print("RESULT " + json.dumps({
    "error": error, "alive": alive, "distributed": dist.is_initialized(), "pool": built,
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}), flush=True)
'''


def test_a_failing_step_releases_the_servers_router_groups_and_signals(tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def reward(prompt, response_ids, response_text):\n"
                   "    raise ValueError('the reward service is down')\n")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    run_dir = tmp_path / "run"
    overrides = [f"run.output_dir={run_dir}", "parallel.expert=1", "rollout.num_servers=1",
                 "run.global_batch_size=16", "run.micro_batch_size=8", "run.eval_interval=0",
                 "reward.kind=function", f"reward.function={bad}:reward",
                 "rollout.outage_timeout_s=42"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, str(driver), CONFIG, *overrides], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    # rank 0's error as its type, with where it happened (megatron_gspo.errors.one_line)
    assert result["error"].startswith("step 1: RewardError: "), result["error"]
    assert "the reward service is down" in result["error"]
    # the server had started (it loaded run_dir/init_hf and logged) and the router with it
    assert (run_dir / "init_hf").is_dir() and len(list((run_dir / "logs").glob("*.log"))) >= 2
    assert result["alive"] == []
    assert result["pool"] == {"outage_timeout_s": 42.0}  # rollout.outage_timeout_s reaches the pool
    assert result["distributed"] is False and result["sigterm_default"] is True
