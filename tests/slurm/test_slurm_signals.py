"""Issue 11, item 2 under a real Slurm: signals that reach every process of the job at once.

``scontrol requeue`` (what a preemption with requeue does) and ``scancel --signal=TERM --full``
send SIGTERM to every process of every step: the batch script, the rollout servers, the router,
the training ranks and every process the ranks started - Megatron's checkpoint-writer helper
among them. The run checkpoints every 2 steps, so that helper exists when the signal comes
(the first checkpoint creates it; with checkpoints only on the signal it did not exist yet,
which is why test_slurm_jobs.py's requeue passed before the fix: it then died of the signal,
the save raised ``BrokenPipeError``, a ``step_N.tmp`` was left and the step exited 1).

One job, three starts: requeued mid-training (Slurm restarts it, it resumes), stopped with
``scancel --signal=TERM --full`` (the trainer checkpoints and exits 75, and so does the job),
then submitted again to the same run directory, where it finishes. Every start must leave a
complete checkpoint and no ``.tmp``, and the run logs every step exactly once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.slurm.local_slurm import launch, raw_steps
from tests.slurm.test_slurm_jobs import JOB_TIMEOUT_S, Job, progress_steps, wait_for_steps

pytestmark = pytest.mark.slow
STEPS = 30


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def latest(run_dir: Path) -> int:
    marker = run_dir / "checkpoints" / "latest"
    return int(marker.read_text().split("_")[1]) if marker.is_file() else 0


def test_requeue_and_scancel_full_checkpoint_with_the_writer_helper_alive(local_slurm, sft_policy,
                                                                         tmp_path):
    run_dir = tmp_path / "run"
    options = ("--set", f"run.init_from={sft_policy}", "--set", "run.eval_interval=0",
               "--set", "run.save_interval=2", "--set", f"run.num_steps={STEPS}")
    job = Job(launch(local_slurm, run_dir, *options), run_dir)

    # 1. preemption-style requeue, after a periodic checkpoint of this start
    local_slurm.wait(job.id, JOB_TIMEOUT_S, what="a periodic checkpoint", log=job.batch_log,
                     until=lambda s: latest(run_dir) >= 2)
    local_slurm.run("scontrol", "requeue", job.id)
    local_slurm.wait(job.id, JOB_TIMEOUT_S, what="restarted", log=job.batch_log,
                     until=lambda s: "restart 1\n" in job.batch_log.read_text())
    first = latest(run_dir)
    assert not [c for c in checkpoints(run_dir) if c.endswith(".tmp")], checkpoints(run_dir)

    # 2. scancel --signal=TERM --full once the restarted job wrote a checkpoint of its own
    local_slurm.wait(job.id, JOB_TIMEOUT_S, what="a checkpoint of the restart", log=job.batch_log,
                     until=lambda s: latest(run_dir) >= first + 2)
    local_slurm.run("scancel", "--signal=TERM", "--full", job.id)
    states = local_slurm.wait(job.id, JOB_TIMEOUT_S, log=job.batch_log)
    second = latest(run_dir)
    text = job.batch_log.read_text()
    run0, run1 = re.split(r"^.*restart 1\n", text, flags=re.M)
    logs = [job.rank_log(restart) + job.rank_log(restart, 1) for restart in range(2)]
    for i, (batch, ranks) in enumerate(zip((run0, run1), logs)):
        assert "training step exited with status 75" in batch, \
            f"start {i}: the trainer did not checkpoint on SIGTERM:\n{batch[-3000:]}\n{ranks[-4000:]}"
        assert "BrokenPipeError" not in ranks and "Traceback" not in ranks, ranks[-4000:]
    assert "stopped by SIGTERM after a checkpoint" in run1, run1[-3000:]
    assert states == ["FAILED", "FAILED"] and local_slurm.job(job.id)["ExitCode"] == "75:0", \
        (states, local_slurm.job(job.id).get("ExitCode"))
    assert not [c for c in checkpoints(run_dir) if c.endswith(".tmp")], checkpoints(run_dir)
    assert second > first and raw_steps(run_dir) == list(range(1, second + 1))

    # 3. submitted again: resumes right after the checkpoint, finishes, every step once
    again = Job(launch(local_slurm, run_dir, *options), run_dir)
    states = local_slurm.wait(again.id, JOB_TIMEOUT_S, log=again.batch_log)
    assert states == ["COMPLETED", "COMPLETED"], again.batch_log.read_text()[-4000:]
    rank0 = again.rank_log(0)
    assert f"(step {second})" in rank0 and progress_steps(rank0) == list(range(second + 1, STEPS + 1))
    assert raw_steps(run_dir) == list(range(1, STEPS + 1))
