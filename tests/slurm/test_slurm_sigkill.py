"""Issue 22 item 1 in a Slurm step: SIGKILL of the training step's srun (the ranks' launcher in a
Slurm job) while the user's reward function sleeps for ever leaves no process of the run alive.

The ranks are tasks of slurmstepd, not children of srun: when srun dies, the batch script
(slurm/lib.sh) sees the training step end, stops the server and router steps and ends the job, and
Slurm ends every task of the job's steps; the rank abandons the hanging reward call on the stop
(``pipeline.scoring.rewards.FunctionReward``), and the reward worker and the checkpoint writer's helper die
with their rank. Every process of the run carries ``RELIABILITY_TAG`` (``--env``), so a process the
job left behind would be found. (One machine: tests/reliability/test_hanging_reward.py.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.reliability.conftest import TAG_ENV, tagged_pids, wait_gone
from tests.reliability.test_hanging_reward import HANGING
from tests.slurm.local_slurm import launch
from tests.slurm.test_slurm_jobs import JOB_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.extended]
SAMPLES_PER_STEP = 32  # run.global_batch_size below


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


@pytest.mark.timeout(900)
def test_sigkill_of_the_training_srun_leaves_no_process_of_the_run(local_slurm, sft_policy, tmp_path):
    reward, marker = tmp_path / "hanging_reward.py", tmp_path / "hanging"
    reward.write_text(HANGING.format(samples=SAMPLES_PER_STEP, marker=str(marker)))
    run_dir = tmp_path / "run"
    tag = f"slurm-sigkill-{os.getpid()}-{time.monotonic_ns()}"
    job = launch(local_slurm, run_dir, "--set", f"run.init_from={sft_policy}",
                 "--set", "run.eval_interval=0", "--set", "run.num_steps=3",
                 "--set", f"run.global_batch_size={SAMPLES_PER_STEP}", "--set", "run.micro_batch_size=8",
                 "--set", "reward.kind=function", "--set", f"reward.function={reward}:reward",
                 "--env", f"{TAG_ENV}={tag}", env={TAG_ENV: tag})
    log = run_dir / "logs" / f"slurm-{job}.out"
    local_slurm.wait(job, JOB_TIMEOUT_S, what="the reward hanging at step 2", log=log,
                     until=lambda states: marker.exists())
    time.sleep(1.0)
    sruns = [pid for pid in tagged_pids(tag)
             if (cmd := _cmdline(pid)) and Path(cmd[0]).name == "srun" and "train" in cmd]
    # srun forks a helper srun of its own: the launcher is the one the batch script started
    trainers = [pid for pid in sruns if _parent(pid) not in sruns]
    assert len(trainers) == 1, [(pid, _parent(pid), _cmdline(pid)) for pid in sruns]
    os.kill(trainers[0], signal.SIGKILL)
    left = wait_gone(tag, timeout=60)
    assert left == [], f"processes left 60 s after SIGKILL of the training srun: " \
                       f"{[(pid, ' '.join(_cmdline(pid))[:200]) for pid in left]}"
    states = local_slurm.wait(job, 60, log=log)
    assert states and all(state != "RUNNING" for state in states), states
