"""Issue 11, item 2 under a real Slurm: ``scancel --signal=TERM --full``.

(The other signal that reaches every process of the job at once, ``scontrol requeue``, with
Megatron's checkpoint-writer helper alive, is test_slurm_jobs.py's requeued job.)

``scancel --signal=TERM --full`` signals the batch script and its children without ending the job:
the srun processes get the SIGTERM, the steps' tasks do not (Slurm 22.05), and srun answers a
SIGTERM of its own by killing its tasks with SIGKILL ("srun: forcing job termination"). Before the
fix the trainer died without a checkpoint (exit 137). Now the trainer's srun runs with the
preload of slurm/lib.sh (it leaves SIGTERM alone) and the batch script passes the stop on to the
ranks: the ranks save the step they were on, the job exits 75 and a resubmitted job resumes right
after that step and finishes, every step logged once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.slurm.local_slurm import launch, raw_steps
from tests.slurm.test_slurm_jobs import JOB_TIMEOUT_S, Job, progress_steps

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # ~5 min: run by .ci/run after the suite
STEPS = 16


def checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def latest(run_dir: Path) -> int:
    marker = run_dir / "checkpoints" / "latest"
    return int(marker.read_text().split("_")[1]) if marker.is_file() else 0


@pytest.mark.timeout(1800)  # two starts of a het job (servers, router, 2 ranks) in a row
def test_scancel_full_checkpoints_exits_75_and_resumes(local_slurm, sft_policy, tmp_path):
    run_dir = tmp_path / "run"
    options = ("--set", f"run.init_from={sft_policy}", "--set", "run.eval_interval=0",
               "--set", "run.save_interval=2", "--set", f"run.num_steps={STEPS}")
    job = Job(launch(local_slurm, run_dir, *options), run_dir)

    # 1. scancel --signal=TERM --full once the run wrote a periodic checkpoint (the writer's
    # helper process exists)
    local_slurm.wait(job.id, JOB_TIMEOUT_S, what="a periodic checkpoint", log=job.batch_log,
                     until=lambda s: latest(run_dir) >= 2)
    logged = len(raw_steps(run_dir))
    local_slurm.run("scancel", "--signal=TERM", "--full", job.id)
    local_slurm.wait(job.id, JOB_TIMEOUT_S, log=job.batch_log)
    run0 = job.batch_log.read_text()
    ranks0 = job.rank_log(0) + job.rank_log(0, 1)
    assert "training step exited with status 75" in run0, \
        f"the trainer did not checkpoint on scancel --full:\n{run0[-3000:]}\n{ranks0[-4000:]}"
    assert "stopped by SIGTERM after a checkpoint (exit 75" in run0, run0[-3000:]
    assert local_slurm.job(job.id)["ExitCode"] == "75:0", local_slurm.job(job.id)
    assert "preempted: checkpoint saved; exit 75" in job.rank_log(0), job.rank_log(0)[-3000:]
    assert "BrokenPipeError" not in ranks0 and "Traceback" not in ranks0, ranks0[-4000:]
    assert not [c for c in checkpoints(run_dir) if c.endswith(".tmp")], checkpoints(run_dir)
    # the checkpoint holds the step the ranks were on when the signal came (or a later one they
    # finished before they saw it), every step logged once
    saved = latest(run_dir)
    steps = raw_steps(run_dir)
    assert saved >= logged >= 2 and steps == list(range(1, saved + 1)), (saved, logged, steps)
    assert json.loads((run_dir / "checkpoints" / f"step_{saved:06d}" / "run_state.json")
                      .read_text())["step"] == saved

    # 2. submitted again: resumes from that checkpoint and finishes
    again = Job(launch(local_slurm, run_dir, *options), run_dir)
    states = local_slurm.wait(again.id, JOB_TIMEOUT_S, log=again.batch_log)
    assert states == ["COMPLETED", "COMPLETED"], again.batch_log.read_text()[-4000:]
    rank0 = again.rank_log(0)
    assert f"(step {saved})" in rank0
    assert progress_steps(rank0) == list(range(saved + 1, STEPS + 1))
    assert sorted(set(raw_steps(run_dir))) == list(range(1, STEPS + 1))
