"""``megatron-gspo launch slurm`` on a real Slurm: the tiny CPU run as a heterogeneous job.

Three virtual nodes on this machine (``local_slurm`` in conftest.py): the rollout component (two
local rollout servers + the sglang-router) on one, the training component (two gloo ranks, one
per node) on the other two. The GSPO runs start from a tiny SFT policy made once per module.

* ``test_gspo_job_completes_with_rising_reward``: the real ``megatron-gspo train``, end to end.
* ``test_requeued_job_resumes_without_losing_or_repeating_a_step``: ``scontrol requeue`` mid-run.
* ``test_time_limit_signal_checkpoints_and_requeues``: the time-limit path (SIGUSR1 to the batch
  script, forwarded to the trainer, self-requeue), with a stand-in trainer (``stub_train.py``)
  so that it takes seconds.
* ``test_server_that_cannot_start_fails_the_job_naming_it``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.local_slurm import ROOT, LocalSlurm, launch, raw_steps

pytestmark = pytest.mark.slow
STUB_PYTHON = Path(__file__).resolve().parent / "stub_python.sh"
GSPO_STEPS = 8            # steps of the complete run
REQUEUE_STEPS = 6         # steps of the requeued run; the requeue comes after step 2


@pytest.fixture(scope="module")
def sft_policy(tmp_path_factory) -> Path:
    """The tiny SFT policy (a Hugging Face directory) the GSPO runs start from."""
    out = tmp_path_factory.mktemp("sft")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "sft", "--config", "launch/configs/tiny_cpu_sft.yaml",
         "--set", f"run.output_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (out / "hf" / "config.json").is_file()
    return out / "hf"


def batch_log(run_dir: Path, job_id: str) -> Path:
    return run_dir / "logs" / f"slurm-{job_id}.out"


def wait_for_steps(run_dir: Path, job_id: str, slurm: LocalSlurm, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(raw_steps(run_dir)) >= count:
            return
        assert set(slurm.states(job_id)) <= {"PENDING", "RUNNING", "CONFIGURING"}, \
            batch_log(run_dir, job_id).read_text()[-4000:]
        time.sleep(0.5)
    raise AssertionError(f"no {count} steps in {timeout} s:\n"
                         f"{batch_log(run_dir, job_id).read_text()[-4000:]}")


def assert_completed(slurm: LocalSlurm, job_id: str, run_dir: Path, timeout: float) -> str:
    log = batch_log(run_dir, job_id)
    states = slurm.wait(job_id, timeout, log=log)
    text = log.read_text()
    assert states == ["COMPLETED", "COMPLETED"], f"states {states}\n{text[-6000:]}"
    assert text.rstrip().endswith("megatron-gspo job: training complete"), text[-4000:]
    return text


def test_gspo_job_completes_with_rising_reward(local_slurm, sft_policy, tmp_path):
    run_dir = tmp_path / "run"
    job = launch(local_slurm, run_dir, "--set", f"run.init_from={sft_policy}",
                 "--set", f"run.num_steps={GSPO_STEPS}", "--set", "run.eval_interval=0",
                 "--set", "run.save_interval=0")
    text = assert_completed(local_slurm, job, run_dir, timeout=240)

    # the het job's layout: servers + router on the first node, one rank on each of the others
    first, second, third = local_slurm.nodes
    assert f"rollout nodes: {first}; training nodes: " in text and f"(master {second}:" in text
    logs = run_dir / "logs" / f"{job}-0"
    assert sorted(p.name for p in logs.iterdir()) == [
        "router.log", "server-task0.log", "server-task1.log", "train-rank0.log", "train-rank1.log"]
    assert "layout: world 2 = " in (logs / "train-rank0.log").read_text()
    # every step logged once, and the reward rises
    assert raw_steps(run_dir) == list(range(1, GSPO_STEPS + 1))
    rewards = [json.loads(line)["train/reward_mean"]
               for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    third_len = max(1, GSPO_STEPS // 3)
    first_mean = sum(rewards[:third_len]) / third_len
    last_mean = sum(rewards[-third_len:]) / third_len
    assert last_mean > first_mean, rewards
    # the job's config is the one file with hyperparameters; the run dir is absolute in it
    assert f"output_dir: {run_dir}" in (run_dir / "slurm" / "config.yaml").read_text()


def test_requeued_job_resumes_without_losing_or_repeating_a_step(local_slurm, sft_policy, tmp_path):
    run_dir = tmp_path / "run"
    job = launch(local_slurm, run_dir, "--set", f"run.init_from={sft_policy}",
                 "--set", f"run.num_steps={REQUEUE_STEPS}", "--set", "run.eval_interval=0",
                 "--set", "run.save_interval=0")  # only the checkpoint taken on SIGTERM
    wait_for_steps(run_dir, job, local_slurm, 2, timeout=180)
    local_slurm.run("scontrol", "requeue", job)
    text = assert_completed(local_slurm, job, run_dir, timeout=240)

    assert local_slurm.job(job)["Restarts"] == "1"
    first, second = text.split("restart 1\n", 1) if "restart 1\n" in text else (text, "")
    assert "SIGTERM: the job is being cancelled, requeued or preempted" in first
    assert "megatron-gspo job: stopped by SIGTERM" in first
    assert "training complete" in second
    # the first run checkpointed its last step k on SIGTERM and exited 75; the restart resumed
    # from that checkpoint at step k + 1: metrics.jsonl holds every step exactly once
    assert raw_steps(run_dir) == list(range(1, REQUEUE_STEPS + 1))
    assert "preempted: checkpoint saved; exit 75" in \
        (run_dir / "logs" / f"{job}-0" / "train-rank0.log").read_text()
    rank0 = (run_dir / "logs" / f"{job}-1" / "train-rank0.log").read_text()
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", rank0)
    assert resumed, rank0[-3000:]
    k = int(resumed.group(1))
    # time_s restarts with the logger: the first record of the second run is step k + 1
    times = [json.loads(line)["time_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    restarts = [i for i in range(1, len(times)) if times[i] < times[i - 1]]
    assert restarts == [k] and 2 <= k < REQUEUE_STEPS, (times, k)


def test_time_limit_signal_checkpoints_and_requeues(local_slurm, tmp_path):
    """SIGUSR1 to the batch script (what --signal=B:USR1@S sends before the time limit)."""
    run_dir = tmp_path / "run"
    job = launch(local_slurm, run_dir, "--model-path", str(_tiny_model(tmp_path)),
                 "--set", "run.num_steps=30",
                 env={"MGSPO_PYTHON": str(STUB_PYTHON), "MGSPO_REAL_PYTHON": sys.executable,
                      "STUB_STEP_S": "0.3"})
    wait_for_steps(run_dir, job, local_slurm, 3, timeout=120)
    local_slurm.run("scancel", "--batch", "--signal=USR1", job)
    text = assert_completed(local_slurm, job, run_dir, timeout=180)
    assert local_slurm.job(job)["Restarts"] == "1"
    assert "SIGUSR1: asking the trainer to checkpoint and stop" in text
    assert "megatron-gspo job: requeued" in text
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    assert {r["restart"] for r in records} == {0, 1}
    # the stand-in trainer saw the job's addresses: master = first training node, both servers
    first, second, _ = local_slurm.nodes
    rank1 = (run_dir / "logs" / f"{job}-1" / "train-rank1.log").read_text()
    assert f"rank 1/2 on {local_slurm.nodes[2]} master {second}:" in rank1
    assert rank1.count(f"http://{first}:") == 2


def test_server_that_cannot_start_fails_the_job_naming_it(local_slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = launch(local_slurm, run_dir, "--model-path", str(tmp_path / "no-such-model"),
                 "--health-timeout-s", "60")
    states = local_slurm.wait(job, 120, log=batch_log(run_dir, job))
    text = batch_log(run_dir, job).read_text()
    assert states == ["FAILED", "FAILED"], text
    first = local_slurm.nodes[0]
    assert re.search(rf"ERROR: server \d \(task \d on {first}\) \(http://{first}:\d+\) exited before "
                     "it was healthy", text), text
    assert "no-such-model" in text  # the end of the server's log names the missing directory
    assert "FAILED: the rollout servers or the router did not come up" in text
    assert not (run_dir / "logs" / f"{job}-0" / "train-rank0.log").exists()


def _tiny_model(tmp_path: Path) -> Path:
    """A Hugging Face directory for the local servers of the stand-in trainer's job."""
    from tests.hf_tiny import build_hf_model, save_hf_model

    return save_hf_model(build_hf_model("gqa2_untied"), tmp_path / "hf")
