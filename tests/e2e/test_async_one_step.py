"""``rollout.async: one_step`` end to end on CPU: 2 Megatron ranks (EP2), 2 local rollout servers
behind the real router; step n+1's rollout runs while step n trains.

* every trained token is exactly one version stale (after the first step), and the decoupled
  objective's behaviour weight and the idle fractions are reported (that the reward rises as in
  the synchronous run: bench/bench_async.py, docs/performance.md);
* a training rank killed with SIGKILL after the checkpoint of step 2, then ``--resume``, ends with
  exactly the weights of an uninterrupted one_step run: the checkpoint holds the finished batch of
  step 3 (made with the weights of step 1), so nothing is lost or made again with other weights.

Run: ``.venv/bin/python -m pytest -q tests/e2e/test_async_one_step.py``
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.observe.metrics import read_metrics
from tests.e2e.conftest import (EP2_REFERENCE, hf_weights, kill_rank_after_checkpoint,
                                megatron_gspo, train_args)

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # the extended tier: .ci/run runs it

ONE_STEP = "rollout.async=one_step"


def test_one_step_kill9_then_resume_is_exact(sft_policy, tmp_path):
    settings = (*EP2_REFERENCE, ONE_STEP)
    reference = tmp_path / "reference"
    megatron_gspo(*train_args(reference, sft_policy, *settings), timeout=900)
    train = [r for r in read_metrics(reference) if "train/reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 7))
    assert train[0]["train/staleness_max"] == 0.0  # made at the start, with the start's weights
    for r in train[1:]:  # every later token: exactly one version behind the trained policy
        assert r["train/staleness_mean"] == r["train/staleness_max"] == 1.0, r["step"]
        assert r["train/staleness_frac_1"] == 1.0
        assert 0.0 < r["train/mismatch_weight_mean"] <= 2.0  # the behaviour weight, capped at C
        assert 0.0 < r["train/mismatch_weight_ess"] <= 1.0
        assert 0.0 <= r["train/trainer_idle_frac"] < 1.0
        assert 0.0 <= r["train/rollout_idle_frac"] <= 1.0

    run_dir = tmp_path / "killed"
    log_path = tmp_path / "killed.log"
    code = kill_rank_after_checkpoint(train_args(run_dir, sft_policy, *settings), run_dir, log_path)
    assert code != 0, log_path.read_text()[-2000:]
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "run_state.json").read_text())
    assert state["rollout_buffer"]["step"] == 3  # the next step's finished batch is saved

    resumed = megatron_gspo(*train_args(run_dir, sft_policy, *settings), "--resume", timeout=900)
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))
    by_step = {r["step"]: r for r in read_metrics(reference)}
    for r in read_metrics(run_dir):  # the same samples: the same rewards, step by step
        assert r["train/reward_mean"] == by_step[r["step"]]["train/reward_mean"], r["step"]
    ref, got = hf_weights(reference / "hf"), hf_weights(run_dir / "hf")
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
