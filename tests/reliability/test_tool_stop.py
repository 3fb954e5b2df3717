"""Issue 38, item 12: a stop signal during slow tool calls ends the run within one tool timeout.

A 2-rank local run with multi-turn trajectories whose environment (``tools.environment``, in
this file's temporary directory) calls a sandboxed tool in every turn: at step 1 the tool
answers at once, from step 2 on it sleeps past ``tools.timeout_s`` (30 s), 4 turns per
trajectory, 32 trajectories on one worker: more than an hour of tool time. SIGTERM to the
launcher during step 2's first call: the sandbox abandons the calls (the rank's stop flag), the
rollout fails, the step guard saves step 1 and the run exits 75 - all within one tool timeout of
the signal.

Before (6787025) each call ran to its timeout, one after the other (the issue measured 325 s
with ``tools.timeout_s: 20``, past Slurm's 300 s warning).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import Run, latest_step, train_args, wait_gone

pytestmark = pytest.mark.slow
TIMEOUT_S = 30
SAMPLES_PER_STEP = 32  # conftest.TINY: 4 prompts x 8 samples

SLOW_TOOLS = '''
import time
from pipeline.generation.environment import EnvStep

_trajectories = []


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "rested"


class NapEnv:
    """Every turn calls nap: at once in step 1's trajectories, then for an hour."""

    def __init__(self, *, executor, tool_format):
        self.executor, self.format = executor, tool_format
        _trajectories.append(1)
        self.slow = len(_trajectories) > {samples}

    def reset(self, prompt):
        return list(prompt.prompt_ids)

    def step(self, text, *, tool_time_left_s):
        if self.slow:
            open({marker!r}, "w").write("calling")
        out = self.executor.call("nap", {{"seconds": 3600 if self.slow else 0}},
                                 timeout_s=tool_time_left_s)
        return EnvStep(observation=self.format.render([out.output]), done=not self.slow,
                       tool_calls=1, tool_seconds=out.seconds)
'''


def test_sigterm_during_slow_tool_calls_exits_within_one_tool_timeout(tmp_path: Path):
    module, marker = tmp_path / "slow_tools.py", tmp_path / "calling"
    module.write_text(SLOW_TOOLS.format(samples=SAMPLES_PER_STEP, marker=str(marker)))
    run_dir = tmp_path / "run"
    run = Run([*train_args(run_dir, "run.num_steps=3", f"tools.functions=[\"{module}:nap\"]",
                           f"tools.environment={module}:NapEnv", "tools.format=plain",
                           "tools.max_turns=4", "tools.workers=1",
                           f"tools.timeout_s={TIMEOUT_S}", "tools.max_tool_time_s=3600"),
               "--nproc", "2"], tmp_path / "run.log")
    try:
        run.wait_until(marker.exists, "step 2's first tool call")
        time.sleep(1.0)  # well inside the call
        start = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        try:
            code = run.wait(timeout=4 * TIMEOUT_S)
        except Exception:
            pytest.fail(f"no exit within {4 * TIMEOUT_S} s of SIGTERM:\n{run.output()[-4000:]}")
        took = time.monotonic() - start
        print(f"exit {code} {took:.1f} s after SIGTERM")
        left = wait_gone(run.tag)
    finally:
        run.kill_everything()
    out = run.output()
    assert code == 75, f"exit {code}:\n{out[-4000:]}"
    assert took < TIMEOUT_S, f"exit {took:.0f} s after SIGTERM (tools.timeout_s {TIMEOUT_S})"
    assert latest_step(run_dir) == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert left == [], left
