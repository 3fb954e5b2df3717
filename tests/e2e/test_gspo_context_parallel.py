"""GSPO end to end with context parallelism and packed micro-batches: ``megatron-gspo train`` on
2 Megatron ranks with ``parallel.context=2`` (each sequence zigzag-split over both ranks; experts
over the same two ranks, EP2) and ``run.max_tokens_per_micro_batch`` (whole sequences packed into
token-budget micro-batches, THD), real rollout servers behind the sglang-router.

* The run trains like the plain EP2 run of test_gspo_run.py (padded rows, no CP) from the same
  start: same rewards step by step, same sequence ratios and clip fractions (the layouts compute
  the same gradients; deterministic rollouts make the samples depend on the weights only).
* A training rank killed with SIGKILL mid-run, then ``--resume``, ends with exactly the weights
  of the uninterrupted run (the pattern of test_gspo_run.py, for this layout).

Reward rising is asserted by test_gspo_run.py for the EP2 run that this one tracks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.observe.metrics import read_metrics
from tests.e2e.conftest import (EP2_REFERENCE, hf_weights, kill_rank_after_checkpoint,
                                megatron_gspo, train_args)

# the extended tier (.ci/run runs it after the README's suite): one of the two longest e2e checks
pytestmark = [pytest.mark.slow, pytest.mark.extended]

LAYOUT = ("parallel.context=2", "parallel.expert=2", "run.max_tokens_per_micro_batch=96")


def _args(run_dir: Path, init: Path, *extra: str) -> list[str]:
    return train_args(run_dir, init, *LAYOUT, *extra)




SETTINGS = EP2_REFERENCE  # the settings of the session's EP2 reference run (tests/e2e/conftest.py)
TRACKED = ("train/reward_mean", "train/log_ratio_seq_mean", "train/clip_frac",
           "train/response_length_mean")


def test_context_parallel_packed_run_tracks_ep2_and_resumes_exactly(sft_policy, ep2_reference,
                                                                   tmp_path):
    settings = SETTINGS
    # the same run without CP and packing: test_gspo_run.py's layout (EP2, padded rows)
    baseline = ep2_reference
    reference = tmp_path / "uninterrupted"
    proc = megatron_gspo(*_args(reference, sft_policy, *settings), timeout=900)
    assert "context 2" in proc.stdout  # the layout line: world 2 = ... x context 2 x ...
    base, cp2 = read_metrics(baseline), read_metrics(reference)
    assert [r["step"] for r in cp2] == [r["step"] for r in base] == list(range(1, 7))
    for b, c in zip(base, cp2):
        # the same log-probs as the rollout engine, from zigzag-split packed sequences
        assert c["train/rollout_trainer_logprob_abs_diff"] < 1e-4
        for key in TRACKED:
            assert abs(c[key] - b[key]) <= 1e-3 * max(1.0, abs(b[key])), (c["step"], key, c[key], b[key])

    # kill -9 of a training rank after the step-2 checkpoint, then --resume
    run_dir = tmp_path / "killed"
    log_path = tmp_path / "killed.log"
    code = kill_rank_after_checkpoint(_args(run_dir, sft_policy, *settings), run_dir, log_path)
    assert code != 0, log_path.read_text()[-2000:]
    assert not (run_dir / "hf").exists()

    resumed = megatron_gspo(*_args(run_dir, sft_policy, *settings), "--resume", timeout=900)
    assert "resumed from" in resumed.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 7))
    ref, got = hf_weights(reference / "hf"), hf_weights(run_dir / "hf")
    assert ref.keys() == got.keys()
    for name in ref:
        assert torch.equal(ref[name], got[name]), name
    start = hf_weights(sft_policy)
    assert any(not torch.equal(ref[n], start[n]) for n in ref)
