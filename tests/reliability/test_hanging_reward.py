"""Issue 22, items 1 and 7: a reward that hangs cannot hang the run, and a stop always ends it.

A 2-rank local run (launcher -> torchrun -> 2 ranks -> rank 0's reward worker, rollout server,
router, checkpoint writer) whose user reward function sleeps for ever from step 2 on:

* SIGTERM to the launcher: the rank abandons the reward call (``pipeline.scoring.rewards.FunctionReward``
  checks the stop flag while it waits for its worker), saves the checkpoint of step 1 (the last
  finished step) and every process of the run is gone within 60 s; exit 75.
* SIGKILL of the launcher: torchrun gets SIGTERM (PR_SET_PDEATHSIG), stops the ranks the same
  way, the reward worker and the servers die with their owner: nothing of the run is left.

Before (8b25bf7) the function ran in rank 0 itself: the signal only set the stop flag, the call
never returned, torchrun waited its 900 s shutdown timeout, and after SIGKILL of the launcher
torchrun, both ranks and the servers stayed.

Item 7: a SIGTERM during the last step (here: from the reward function, during the last step's
evaluation). The run finishes and writes hf/; the launcher exits 0 (it exited 143 with
``ranks [] ended without reporting``).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import Run, latest_step, tagged_pids, train_args, wait_gone

pytestmark = pytest.mark.slow
SAMPLES_PER_STEP = 32  # conftest.TINY: 4 prompts x 8 samples

HANGING = '''
import os, time
_calls = []

def reward(prompt, response_ids, response_text):
    _calls.append(1)
    if len(_calls) > {samples}:  # step 2: sleep for ever
        open({marker!r}, "w").write(str(os.getpid()))
        while True:
            time.sleep(3600)
    return float(len(response_ids) % 2)
'''


def _hanging_run(tmp_path: Path) -> tuple[Run, Path, Path]:
    reward = tmp_path / "hanging_reward.py"
    marker = tmp_path / "hanging"
    reward.write_text(HANGING.format(samples=SAMPLES_PER_STEP, marker=str(marker)))
    run_dir = tmp_path / "run"
    run = Run([*train_args(run_dir, "run.num_steps=3", "reward.kind=function",
                           f"reward.function={reward}:reward"), "--nproc", "2"],
              tmp_path / "run.log")
    run.wait_until(marker.exists, "the reward hanging at step 2")
    time.sleep(1.0)  # well inside the call
    return run, run_dir, marker


@pytest.mark.extended
def test_sigterm_ends_a_run_whose_reward_hangs_and_keeps_the_last_step(tmp_path):
    run, run_dir, _ = _hanging_run(tmp_path)
    try:
        start = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        try:
            code = run.wait(timeout=60)
        except Exception:
            pytest.fail(f"the launcher did not exit within 60 s of SIGTERM:\n{run.output()[-4000:]}")
        left = wait_gone(run.tag, timeout=max(1.0, 60 - (time.monotonic() - start)))
    finally:
        run.kill_everything()
    out = run.output()
    assert left == [], f"processes left 60 s after SIGTERM: {left}\n{out[-4000:]}"
    assert code == 75, f"exit {code}:\n{out[-4000:]}"
    assert latest_step(run_dir) == 1, out[-4000:]
    assert (run_dir / "checkpoints" / "step_000001" / "run_state.json").is_file()
    assert "stopped after saving a checkpoint; exit 75" in out
    assert "Traceback" not in out, out[-4000:]


@pytest.mark.extended
def test_sigkill_of_the_launcher_leaves_no_process_of_the_run(tmp_path):
    run, run_dir, marker = _hanging_run(tmp_path)
    try:
        pids = tagged_pids(run.tag)
        assert len(pids) >= 5, pids  # launcher, torchrun, 2 ranks, server (+ router, worker)
        assert int(marker.read_text()) in pids  # the process the function hangs in
        run.proc.send_signal(signal.SIGKILL)
        run.wait(timeout=10)
        left = wait_gone(run.tag, timeout=60)
    finally:
        run.kill_everything()
    assert left == [], f"processes left 60 s after SIGKILL of the launcher: {left}"


SIGNALS_LAUNCHER = '''
import os, signal
_calls = []

def reward(prompt, response_ids, response_text):
    _calls.append(1)
    if len(_calls) == {first_of_last_eval}:  # the last step's evaluation has begun
        os.kill(int(open({pid_file!r}).read()), signal.SIGTERM)
    return float(len(response_ids) % 2)
'''


@pytest.mark.extended
def test_sigterm_during_the_last_step_finishes_the_run_with_exit_0(tmp_path):
    eval_samples = 2 * 4  # data.num_eval_prompts x rollout.eval_samples_per_prompt
    reward, pid_file = tmp_path / "signals_launcher.py", tmp_path / "launcher.pid"
    # calls: step 0's evaluation, step 1's rollout, then step 1's (the last) evaluation
    reward.write_text(SIGNALS_LAUNCHER.format(
        first_of_last_eval=eval_samples + SAMPLES_PER_STEP + 1, pid_file=str(pid_file)))
    run_dir = tmp_path / "run"
    run = Run([*train_args(run_dir, "run.num_steps=1", "run.eval_interval=1",
                           "data.num_eval_prompts=2", "rollout.eval_samples_per_prompt=4",
                           "reward.kind=function", f"reward.function={reward}:reward"),
               "--nproc", "2"], tmp_path / "run.log")
    pid_file.write_text(str(run.proc.pid))
    try:
        code = run.wait(timeout=600)
        left = wait_gone(run.tag)
    finally:
        run.kill_everything()
    out = run.output()
    assert "step 1/1" in out, out[-4000:]
    assert (run_dir / "hf" / "model.safetensors.index.json").is_file(), out[-4000:]
    assert code == 0, f"exit {code}:\n{out[-4000:]}"
    assert "without reporting" not in out, out[-4000:]
    assert "the run finished (the stop signal came during its last step)" in out, out[-4000:]
    assert left == [], left
