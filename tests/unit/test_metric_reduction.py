"""Per-micro-batch metrics combine into the metric of the whole batch (metric_reduction.REDUCTIONS).

Two references, both independent of the combining code: numbers worked out by hand for three
micro-batches of very different token counts (one of them empty), and ``gspo_loss`` called once on
the whole batch, which must equal ``gspo_loss`` on its micro-batches combined, for every variant
with every optional term.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from megatron_gspo.loss.gspo import VARIANTS, gspo_loss
from megatron_gspo.train.metric_reduction import REDUCTIONS, combine_metrics

# A: 2 sequences of 4 and 6 tokens, log s_i 0.1 and 0.3, 1 token cut low, 2 cut high, 1 of the
#    2 sequences cut, loss sum -1.0.
# B: 1 sequence of 30 tokens, log s_i -0.2, 3 tokens cut low, loss sum 0.5.
# C: no sequence at all (padding rows): gspo_loss reports 0 for everything.
A = {"num_sequences": 2, "num_tokens": 10, "loss": -1.0, "policy_loss": -1.0,
     "token_clip_frac_low": 0.1, "token_clip_frac_high": 0.2, "token_clip_frac": 0.3,
     "clip_frac": 0.5, "response_length_mean": 5.0, "response_length_min": 4.0,
     "response_length_max": 6.0, "log_ratio_seq_mean": 0.2, "log_ratio_seq_std": 0.1,
     "log_ratio_seq_min": 0.1, "log_ratio_seq_max": 0.3, "loss_sum": -1.0}
B = {"num_sequences": 1, "num_tokens": 30, "loss": 0.5, "policy_loss": 0.5,
     "token_clip_frac_low": 0.1, "token_clip_frac_high": 0.0, "token_clip_frac": 0.1,
     "clip_frac": 0.0, "response_length_mean": 30.0, "response_length_min": 30.0,
     "response_length_max": 30.0, "log_ratio_seq_mean": -0.2, "log_ratio_seq_std": 0.0,
     "log_ratio_seq_min": -0.2, "log_ratio_seq_max": -0.2, "loss_sum": 0.5}
C = {key: 0.0 for key in A}


def test_hand_computed_combination():
    out = combine_metrics([A, C, B])
    assert out["num_sequences"] == 3 and out["num_tokens"] == 40
    # token fractions: cut tokens over all 40 tokens (by sequences it would be (0.2*2 + 0)/3)
    assert out["token_clip_frac_low"] == pytest.approx((1 + 3) / 40, abs=1e-15)
    assert out["token_clip_frac_high"] == pytest.approx(2 / 40, abs=1e-15)
    assert out["token_clip_frac"] == pytest.approx((3 + 3) / 40, abs=1e-15)
    # sequence means: over the 3 sequences
    assert out["clip_frac"] == pytest.approx(1 / 3, abs=1e-15)
    assert out["response_length_mean"] == pytest.approx((4 + 6 + 30) / 3, abs=1e-13)
    assert out["log_ratio_seq_mean"] == pytest.approx((0.1 + 0.3 - 0.2) / 3, abs=1e-15)
    assert out["log_ratio_seq_std"] == pytest.approx(statistics.pstdev([0.1, 0.3, -0.2]), abs=1e-15)
    # extremes over the micro-batches that hold sequences (C's 0 sentinel is not a length)
    assert (out["response_length_min"], out["response_length_max"]) == (4.0, 30.0)
    assert (out["log_ratio_seq_min"], out["log_ratio_seq_max"]) == (-0.2, 0.3)
    # the loss: sum over all sequences / number of sequences
    assert out["loss"] == pytest.approx((-1.0 + 0.5) / 3, abs=1e-15)
    assert "loss_sum" not in out


def test_only_empty_microbatches_give_zeros():
    out = combine_metrics([C, C])
    assert out["num_sequences"] == 0 and out["token_clip_frac"] == 0.0
    assert out["response_length_min"] == 0.0 and out["log_ratio_seq_std"] == 0.0


def test_an_unlisted_metric_is_an_error():
    with pytest.raises(KeyError, match="'new_metric_frac' has no entry in .*REDUCTIONS"):
        combine_metrics([{**A, "new_metric_frac": 0.5}])


def _batch(seed: int = 0):
    """12 rows of 0..13 response tokens (row 5 empty), float64."""
    gen = torch.Generator().manual_seed(seed)
    rows, length = 12, 14
    lengths = torch.tensor([3, 13, 1, 7, 10, 0, 2, 12, 5, 9, 4, 11])
    mask = torch.arange(length)[None, :] < lengths[:, None]
    log_probs = -torch.rand(rows, length, generator=gen, dtype=torch.float64) * 3
    return {
        "log_probs": log_probs,
        "old_log_probs": log_probs + 0.3 * torch.randn(rows, length, generator=gen, dtype=torch.float64),
        "rollout_log_probs": log_probs + 0.3 * torch.randn(rows, length, generator=gen,
                                                           dtype=torch.float64),
        "ref_log_probs": log_probs + 0.2 * torch.randn(rows, length, generator=gen, dtype=torch.float64),
        "entropy": torch.rand(rows, length, generator=gen, dtype=torch.float64) * 2,
        "advantages": torch.randn(rows, generator=gen, dtype=torch.float64),
        "response_mask": mask,
    }


@pytest.mark.parametrize("variant", VARIANTS)
def test_combined_microbatches_equal_the_whole_batch(variant):
    batch = _batch()
    eps = (0.2, 0.28) if variant in ("grpo", "seq_ratio_token_clip") else (0.05, 0.06)

    def metrics(rows: slice) -> dict:
        _, out = gspo_loss(
            batch["log_probs"][rows], batch["old_log_probs"][rows], batch["advantages"][rows],
            batch["response_mask"][rows], eps_low=eps[0], eps_high=eps[1], variant=variant,
            loss_denominator=1.0, ref_log_probs=batch["ref_log_probs"][rows], kl_coef=0.1,
            entropy=batch["entropy"][rows], entropy_coef=0.01,
            rollout_log_probs=batch["rollout_log_probs"][rows], mismatch_cap=1.2)
        return {k: float(v) for k, v in out.items()}

    whole = metrics(slice(0, 12))
    # micro-batches of 1, 7 and 4 rows (16, 42 and 32 tokens): mis-weighting would show
    combined = combine_metrics([metrics(slice(0, 1)), metrics(slice(1, 8)), metrics(slice(8, 12))])
    assert set(combined) == set(whole)
    assert set(whole) <= set(REDUCTIONS)
    clip = ("clip_frac" if "clip_frac" in whole else "token_clip_frac" if "token_clip_frac" in whole
            else "sapo_gate_weight_mean")  # sapo: no clip, its gate's weights
    assert 0 < whole[clip] < 1 and 0 < whole["mismatch_capped_frac"] < 1  # not trivially 0 or 1
    for key, value in whole.items():
        expected = value / whole["num_sequences"] if key in ("loss", "policy_loss") else value
        assert combined[key] == pytest.approx(expected, rel=1e-12, abs=1e-12), key
