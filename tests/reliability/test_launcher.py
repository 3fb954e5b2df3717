"""Issue 11, items 5 and 11: the local launcher starts N ranks and reports their end ONCE.

* ``--nproc N`` for N >= 2 (torchrun read ``--nproc`` as an ambiguous prefix of its own
  ``--nproc-per-node`` and refused to start): ``sft --nproc 2`` here, ``train --nproc 2`` in
  test_signals.py.
* An input error found after the ranks started (a reward that fails for every sample with
  ``reward.on_error: zero``, which also used to exit 0, item 12) exits 2 with one message on the
  console, not the 70-250 lines of every rank's traceback, gloo's errors and torchrun's report
  (those stay in the run's logs).
* A rank killed by a signal is named as the root cause (exit 1), and nothing of the run is left.
"""

from __future__ import annotations

import re

import pytest

from tests.reliability.conftest import SFT_CONFIG, Run, megatron_gspo, tagged_pids, train_args

pytestmark = pytest.mark.slow


def test_sft_with_two_local_ranks(tmp_path):
    run_dir = tmp_path / "sft"
    proc = megatron_gspo("sft", "--config", SFT_CONFIG, "--set", f"run.output_dir={run_dir}",
                         "--set", "run.num_steps=2", "--set", "run.eval_interval=0", "--nproc", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layout: world 2 " in proc.stdout and "step 2/2" in proc.stdout
    assert (run_dir / "logs" / "rank1.log").is_file() and (run_dir / "hf" / "config.json").is_file()


def test_an_input_error_after_the_ranks_start_is_one_message_and_exit_2(tmp_path):
    reward = tmp_path / "flaky_service.py"
    reward.write_text("def always_fails(prompt, response_ids, response_text):\n"
                      "    raise ValueError('the reward service is down')\n")
    run_dir = tmp_path / "run"
    proc = megatron_gspo(*train_args(run_dir, "run.num_steps=4", "reward.kind=function",
                                     f"reward.function={reward}:always_fails",
                                     "reward.on_error=zero"), "--nproc", "2")
    console = proc.stdout + proc.stderr
    assert proc.returncode == 2, console[-5000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{proc.stderr[-5000:]}"
    assert lines[0].startswith("megatron-gspo train: rank ")
    for fragment in ("RewardError", "every one of the 32 rewards failed", "always_fails",
                     "ValueError: the reward service is down", "reward.on_error"):
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in console and "ChildFailedError" not in console
    assert "step 1/4" not in proc.stdout  # it stopped at the first step
    # the details are in the logs
    assert "Root Cause (first observed failure)" in (run_dir / "logs" / "torchrun.log").read_text()
    assert "RewardError" in (run_dir / "logs" / "rank1.log").read_text()


def test_a_reward_error_in_the_step_0_evaluation_is_one_message_and_exit_2(tmp_path):
    """Issue 22 item 4, issue 34 item 4: the error crosses ranks as its type
    (megatron_gspo/collectives.py ``on_rank0``; the InputError marker of megatron_gspo/errors.py);
    "step 1: evaluation: RewardError: ..." used to miss the launcher's pattern: exit 1, traceback."""
    reward = tmp_path / "flaky_service.py"
    reward.write_text("def always_fails(prompt, response_ids, response_text):\n"
                      "    raise ValueError('the reward service is down')\n")
    run_dir = tmp_path / "run"
    proc = megatron_gspo(*train_args(run_dir, "run.num_steps=2", "run.eval_interval=1",
                                     "data.num_eval_prompts=4", "reward.kind=function",
                                     f"reward.function={reward}:always_fails",
                                     "reward.on_error=zero"))
    console = proc.stdout + proc.stderr
    assert proc.returncode == 2, console[-5000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"{len(lines)} lines on stderr:\n{proc.stderr[-5000:]}"
    # the launcher names the rank whose report came first (every rank raises the relayed error)
    assert re.match(r"megatron-gspo train: rank \d: step 1: evaluation: RewardError: ",
                    lines[0]), lines[0]
    assert "always_fails" in lines[0] and "Traceback" not in console
    assert "step 1/2" not in proc.stdout  # it stopped in the evaluation before the first step


def test_a_rank_killed_by_a_signal_is_the_root_cause_and_nothing_is_left(tmp_path):
    reward = tmp_path / "killer.py"
    # the function runs in rank 0's reward worker (pipeline.scoring.rewards.FunctionReward): its parent
    # is rank 0
    reward.write_text("import os, signal\n"
                      "def reward(prompt, response_ids, response_text):\n"
                      "    os.kill(os.getppid(), signal.SIGKILL)\n")
    run_dir = tmp_path / "run"
    run = Run([*train_args(run_dir, "run.num_steps=4", "reward.kind=function",
                           f"reward.function={reward}:reward"), "--nproc", "2"],
              tmp_path / "killed.log")
    try:
        code = run.wait(timeout=600)
        left = tagged_pids(run.tag)
    finally:
        run.kill_everything()
    out = run.output()
    assert code == 1, out[-5000:]
    assert "megatron-gspo train: rank 0 was killed by SIGKILL" in out, out[-5000:]
    assert left == [], left
    assert out.count("Traceback") == 0, out[-5000:]
