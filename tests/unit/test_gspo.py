"""GSPO loss family against the independent float64 loop in tests/unit/gspo_reference.py.

Values and gradients for every variant, clip semantics, the worked check of docs/gspo_math.md,
numerical robustness, the loss denominator, and the context-parallel decomposition through
``sequence_reduce`` (two fake ranks in one process).
"""

import math
from dataclasses import dataclass, replace

import pytest
import torch

from tests.unit.gspo_reference import reference_loss
from megatron_gspo.loss.advantages import group_advantages
from megatron_gspo.loss.variants import SPECS, TOKEN_NORMALIZED_VARIANTS, GmpoParams, SapoParams
from megatron_gspo.loss.gspo import (
    SEQUENCE_CLIP_VARIANTS,
    TOKEN_CLIP_VARIANTS,
    VARIANTS,
    gspo_loss,
    sequence_log_ratio,
)

EPS = 0.05  # wide enough that random ratios land on both sides of the range, and inside it
GROUP_SIZE = 4


@dataclass
class Batch:
    log_probs: torch.Tensor  # [B, T]; -inf outside the response mask
    old_log_probs: torch.Tensor  # [B, T]; -inf outside the response mask
    advantages: torch.Tensor  # [B] or [B, T]
    is_response_token: torch.Tensor  # [B, T] bool
    ref_log_probs: torch.Tensor
    entropy: torch.Tensor
    rollout_log_probs: torch.Tensor


def make_batch(seed: int, *, num_sequences: int = 24, max_len: int = 10, per_token_advantages: bool = False) -> Batch:
    """Random float64 batch: padding rows (0, 5), a length-1 row (1), a full row (2), a zero-std
    group (rows 4..7 have A = 0), sequence log-ratios in [-0.15, 0.15] plus token noise."""
    generator = torch.Generator().manual_seed(seed)

    def uniform(*shape, low=0.0, high=1.0):
        return low + (high - low) * torch.rand(*shape, generator=generator, dtype=torch.float64)

    def normal(*shape, std=1.0):
        return std * torch.randn(*shape, generator=generator, dtype=torch.float64)

    lengths = torch.randint(1, max_len + 1, (num_sequences,), generator=generator)
    lengths[[0, 5]] = 0
    lengths[1] = 1
    lengths[2] = max_len
    is_response_token = torch.zeros(num_sequences, max_len, dtype=torch.bool)
    for row, length in enumerate(lengths.tolist()):
        start = int(torch.randint(0, max_len - length + 1, (1,), generator=generator))
        is_response_token[row, start:start + length] = True

    old_log_probs = -uniform(num_sequences, max_len, low=0.05, high=3.0)
    sequence_shift = uniform(num_sequences, 1, low=-0.15, high=0.15)
    log_probs = old_log_probs + sequence_shift + normal(num_sequences, max_len, std=0.08)
    rewards = normal(num_sequences)
    rewards[GROUP_SIZE:2 * GROUP_SIZE] = 1.0
    advantages = group_advantages(rewards, GROUP_SIZE)
    if per_token_advantages:
        advantages = advantages[:, None] + normal(num_sequences, max_len, std=0.5)
        advantages[GROUP_SIZE:2 * GROUP_SIZE] = 0.0
    ref_log_probs = log_probs + normal(num_sequences, max_len, std=0.1)
    rollout_log_probs = old_log_probs + normal(num_sequences, max_len, std=0.15)
    entropy = uniform(num_sequences, max_len, low=0.0, high=2.0)
    # garbage outside the mask must not reach the loss or the gradient
    log_probs = log_probs.masked_fill(~is_response_token, -math.inf)
    old_log_probs = old_log_probs.masked_fill(~is_response_token, -math.inf)
    rollout_log_probs = rollout_log_probs.masked_fill(~is_response_token, math.nan)
    return Batch(log_probs, old_log_probs, advantages, is_response_token, ref_log_probs, entropy, rollout_log_probs)


OPTIONAL_TERMS = dict(kl_coef=0.3, entropy_coef=0.01, mismatch_cap=1.1, loss_denominator=40.0)


def run_loss(batch: Batch, variant: str, dtype=torch.float64, *, response_mask=None, optional_terms=False, **kwargs):
    """gspo_loss and its gradients w.r.t. log_probs (and entropy); inputs cast to ``dtype``."""
    log_probs = batch.log_probs.to(dtype).requires_grad_()
    entropy = batch.entropy.to(dtype).requires_grad_()
    if optional_terms:
        kwargs = dict(ref_log_probs=batch.ref_log_probs.to(dtype), entropy=entropy,
                      rollout_log_probs=batch.rollout_log_probs.to(dtype)) | OPTIONAL_TERMS | kwargs
    loss, metrics = gspo_loss(
        log_probs, batch.old_log_probs.to(dtype), batch.advantages.to(dtype),
        batch.is_response_token if response_mask is None else response_mask,
        eps_low=EPS, eps_high=EPS, variant=variant, **kwargs,
    )
    inputs = [log_probs, entropy] if optional_terms else [log_probs]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    grad_entropy = grads[1] if optional_terms else None
    return loss, grads[0], grad_entropy, metrics


def run_reference(batch: Batch, variant: str, dtype=torch.float64, *, optional_terms=False):
    """The reference on the same (dtype-rounded) inputs, in float64 Python floats."""
    def as_lists(tensor):
        return tensor.to(dtype).double().tolist()

    kwargs = {}
    if optional_terms:
        kwargs = dict(ref_log_probs=as_lists(batch.ref_log_probs), entropy=as_lists(batch.entropy),
                      rollout_log_probs=as_lists(batch.rollout_log_probs)) | OPTIONAL_TERMS
    return reference_loss(as_lists(batch.log_probs), as_lists(batch.old_log_probs), as_lists(batch.advantages),
                          batch.is_response_token.tolist(), eps_low=EPS, eps_high=EPS, variant=variant, **kwargs)


def assert_clipping_exercised(batch: Batch, variant: str, info: list[dict]) -> None:
    """The random batch must hit every branch of the clip rule, or the comparison proves little."""
    if SPECS[variant].cut_stats == "none":  # sapo: no clip; its gate is compared as it is
        return
    if SPECS[variant].cut_stats == "sequence":
        sides = [row["cut"] for row in info if row["n"] > 0]
        assert "low" in sides and "high" in sides and "" in sides
        # A < 0 with the ratio above the range: the unclipped (pessimistic) branch, full gradient
        ratio = (lambda row: math.exp(row["log_s"] * (row["n"] if variant == "seq_ratio_unnormalized" else 1)))
        assert any(row["n"] > 0 and row["A"] < 0 and ratio(row) > 1 + EPS and row["cut"] == "" for row in info)
    else:
        sides = [side for row in info for side in row["token_cuts"]]
        assert "low" in sides and "high" in sides and "" in sides


# ---------------------------------------------------------------------------------------------
# Values and gradients against the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["float64", "float32"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(variant, dtype, tol, seed):
    batch = make_batch(seed)
    loss, grad, _, metrics = run_loss(batch, variant, dtype)
    expected_loss, expected_grad, _, info = run_reference(batch, variant, dtype)
    assert_clipping_exercised(batch, variant, info)

    assert loss.dtype == dtype
    assert abs(loss.item() - expected_loss) < tol
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=dtype), rtol=tol, atol=tol)
    # padding rows and padding positions: no gradient; zero-std group (A = 0): no gradient
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[~batch.is_response_token], torch.zeros_like(grad[~batch.is_response_token]))
    assert torch.equal(grad[GROUP_SIZE:2 * GROUP_SIZE], torch.zeros_like(grad[GROUP_SIZE:2 * GROUP_SIZE]))
    assert metrics["num_sequences"].item() == sum(row["n"] > 0 for row in info)  # padding rows not counted


def test_sapo_params_reach_the_gate():
    """``params=SapoParams(...)``: the temperatures the reference is given, not the defaults."""
    batch = make_batch(0)
    params = SapoParams(tau_pos=0.7, tau_neg=1.6)
    loss, grad, _, _ = run_loss(batch, "sapo", params=params)
    default_loss, _, _, _ = run_loss(batch, "sapo")
    expected_loss, expected_grad, _, _ = reference_loss(
        batch.log_probs.tolist(), batch.old_log_probs.tolist(), batch.advantages.tolist(),
        batch.is_response_token.tolist(), eps_low=EPS, eps_high=EPS, variant="sapo",
        sapo_tau_pos=0.7, sapo_tau_neg=1.6)
    assert abs(loss.item() - expected_loss) < 1e-10 and abs(loss.item() - default_loss.item()) > 1e-6
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_metrics_match_reference(variant):
    batch = make_batch(3)
    _, _, _, metrics = run_loss(batch, variant, optional_terms=True)
    _, _, _, info = run_reference(batch, variant, optional_terms=True)
    rows = [row for row in info if row["n"] > 0]
    lengths = [row["n"] for row in rows]
    log_s = [row["log_s"] for row in rows]
    mean_log_s = sum(log_s) / len(rows)
    expected = {
        "num_sequences": len(rows),
        "num_tokens": sum(lengths),
        "response_length_mean": sum(lengths) / len(rows),
        "response_length_min": min(lengths),
        "response_length_max": max(lengths),
        "log_ratio_seq_mean": mean_log_s,
        "log_ratio_seq_std": math.sqrt(sum((x - mean_log_s) ** 2 for x in log_s) / len(rows)),
        "log_ratio_seq_min": min(log_s),
        "log_ratio_seq_max": max(log_s),
        "kl_mean": sum(row["kl"] for row in rows) / len(rows),
        "entropy_mean": sum(row["entropy"] for row in rows) / len(rows),
        "mismatch_weight_mean": sum(row["mismatch_weight"] for row in rows) / len(rows),
        "mismatch_weight_max": max(row["mismatch_weight"] for row in rows),
        "mismatch_weight_ess": sum(row["mismatch_weight"] for row in rows) ** 2
        / (len(rows) * sum(row["mismatch_weight"] ** 2 for row in rows)),
        "mismatch_capped_frac": sum(row["mismatch_weight"] == OPTIONAL_TERMS["mismatch_cap"] for row in rows)
        / len(rows),
    }
    mask = batch.is_response_token
    expected["mismatch_log_prob_abs_diff_mean"] = (
        (batch.old_log_probs - batch.rollout_log_probs)[mask].abs().sum().item() / sum(lengths))
    if SPECS[variant].cut_stats == "sequence":
        for side in ("low", "high"):
            expected[f"clip_frac_{side}"] = sum(row["cut"] == side for row in rows) / len(rows)
        expected["clip_frac"] = expected["clip_frac_low"] + expected["clip_frac_high"]
        assert expected["clip_frac_low"] > 0 and expected["clip_frac_high"] > 0
    elif SPECS[variant].cut_stats == "none":  # sapo: the gate's gradient weights per token
        weights = [g for row in rows for g in row["gate_weights"]]
        expected["sapo_gate_weight_mean"] = sum(weights) / len(weights)
        expected["sapo_gate_weight_low_frac"] = sum(g < 0.5 for g in weights) / len(weights)
        assert min(weights) < 0.99 < max(weights) <= 1.0  # the gate attenuates some tokens
    else:
        cuts = [side for row in rows for side in row["token_cuts"]]
        for side in ("low", "high"):
            expected[f"token_clip_frac_{side}"] = cuts.count(side) / len(cuts)
        expected["token_clip_frac"] = expected["token_clip_frac_low"] + expected["token_clip_frac_high"]
    assert 0 < expected["mismatch_capped_frac"] < 1

    assert set(metrics) == set(expected) | {"loss", "policy_loss"}
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-12), name
    assert all(not value.requires_grad and value.dim() == 0 for value in metrics.values())
    policy = -sum(row["mismatch_weight"] * row["J"] * row["scale"]
                  for row in rows) / OPTIONAL_TERMS["loss_denominator"]
    assert metrics["policy_loss"].item() == pytest.approx(policy, abs=1e-12)


@pytest.mark.parametrize("variant", VARIANTS)
def test_optional_terms_match_reference(variant):
    """KL (k3), entropy bonus and the mismatch weight, with an explicit loss denominator."""
    batch = make_batch(2)
    loss, grad, grad_entropy, metrics = run_loss(batch, variant, optional_terms=True)
    expected_loss, expected_grad, expected_grad_entropy, info = run_reference(batch, variant, optional_terms=True)
    assert_clipping_exercised(batch, variant, info)
    assert abs(loss.item() - expected_loss) < 1e-10
    assert metrics["loss"].item() == loss.item()
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad_entropy, torch.tensor(expected_grad_entropy, dtype=torch.float64),
                               rtol=1e-10, atol=1e-10)
    assert torch.equal(grad[~batch.is_response_token], torch.zeros_like(grad[~batch.is_response_token]))


@pytest.mark.parametrize("variant", TOKEN_CLIP_VARIANTS)
def test_per_token_advantages_match_reference(variant):
    batch = make_batch(4, per_token_advantages=True)
    loss, grad, _, _ = run_loss(batch, variant)
    expected_loss, expected_grad, _, info = run_reference(batch, variant)
    assert_clipping_exercised(batch, variant, info)
    assert abs(loss.item() - expected_loss) < 1e-10
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-10, atol=1e-10)


def test_gspo_token_equals_gspo_for_constant_advantages():
    batch = make_batch(5)
    per_token = replace(batch, advantages=batch.advantages[:, None].expand_as(batch.log_probs).clone())
    loss, grad, _, _ = run_loss(batch, "gspo")
    loss_token, grad_token, _, _ = run_loss(per_token, "gspo_token")
    assert abs(loss.item() - loss_token.item()) < 1e-12
    torch.testing.assert_close(grad_token, grad, rtol=1e-12, atol=1e-12)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("variant", SEQUENCE_CLIP_VARIANTS)
def test_sequence_clip_variants_take_constant_per_token_advantages(variant):
    batch = make_batch(6)
    per_token = replace(batch, advantages=batch.advantages[:, None].expand_as(batch.log_probs).clone())
    per_token.advantages[~batch.is_response_token] = math.nan  # ignored outside the mask
    loss, grad, _, _ = run_loss(batch, variant)
    loss_token, grad_token, _, _ = run_loss(per_token, variant)
    assert abs(loss.item() - loss_token.item()) < 1e-12
    torch.testing.assert_close(grad_token, grad, rtol=1e-12, atol=1e-12)

    varying = replace(batch, advantages=make_batch(6, per_token_advantages=True).advantages)
    with pytest.raises(ValueError, match=rf"variant '{variant}' .* advantages\[\d+\] varies"):
        run_loss(varying, variant)


# ---------------------------------------------------------------------------------------------
# Hand-computed cases
# ---------------------------------------------------------------------------------------------


def sequences_with_ratios(ratios: list[float], lengths: list[int], seed: int = 0):
    """``[B, T]`` old/new log-probs whose sequence ratios are exactly ``ratios`` (token noise sums to 0)."""
    generator = torch.Generator().manual_seed(seed)
    max_len = max(lengths)
    old_log_probs = -torch.rand(len(ratios), max_len, generator=generator, dtype=torch.float64) - 0.1
    is_response_token = torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]
    noise = 0.02 * torch.randn(len(ratios), max_len, generator=generator, dtype=torch.float64)
    noise = torch.where(is_response_token, noise, 0.0)
    noise = noise - noise.sum(-1, keepdim=True) / torch.tensor(lengths, dtype=torch.float64)[:, None]
    log_probs = old_log_probs + torch.log(torch.tensor(ratios, dtype=torch.float64))[:, None] + noise
    return log_probs, old_log_probs, is_response_token


@pytest.mark.parametrize("variant", ["gspo", "gspo_token"])
def test_worked_check_from_gspo_math(variant):
    advantages = group_advantages(torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64), 3)
    assert advantages.tolist() == pytest.approx([1.2247, 0.0, -1.2247], abs=1e-4)
    log_probs, old_log_probs, is_response_token = sequences_with_ratios([1.04, 0.97, 1.08], [3, 2, 4])
    torch.testing.assert_close(sequence_log_ratio(log_probs, old_log_probs, is_response_token).exp(),
                               torch.tensor([1.04, 0.97, 1.08], dtype=torch.float64))
    log_probs.requires_grad_()
    loss, metrics = gspo_loss(log_probs, old_log_probs, advantages, is_response_token, eps_low=0.05, eps_high=0.05,
                              variant=variant)
    # J = (1.04 * 1.2247 + 0 - 1.08 * 1.2247) / 3 = -0.0163; y3 takes s*A (not clip(s)*A = 1.05*A)
    assert loss.item() == pytest.approx(0.0163, abs=1e-4)
    assert loss.item() == pytest.approx(-(1.04 - 1.08) * advantages[0].item() / 3, abs=1e-12)
    (grad,) = torch.autograd.grad(loss, log_probs)
    for row, (ratio, length) in enumerate([(1.04, 3), (0.97, 2), (1.08, 4)]):
        expected = -ratio * advantages[row].item() / length / 3  # every token of a sequence: same weight
        torch.testing.assert_close(grad[row, :length], torch.full((length,), expected, dtype=torch.float64))
    assert grad[0].abs().sum() > 0 and grad[2].abs().sum() > 0 and grad[1].abs().sum() == 0
    if variant == "gspo":
        assert metrics["clip_frac"].item() == 0.0


SEQUENCE_RATIO_VARIANTS = ("gspo", "gspo_token", "token_ratio_seq_clip", "seq_ratio_unnormalized")


@pytest.mark.parametrize("variant", SEQUENCE_RATIO_VARIANTS)
@pytest.mark.parametrize(
    "ratio, advantage, gradient_flows",
    [
        (1.20, +1.0, False),  # A > 0, s > 1 + eps_high: clipped, zero gradient
        (0.80, -1.0, False),  # A < 0, s < 1 - eps_low: clipped, zero gradient
        (1.20, -1.0, True),  # A < 0, s > 1 + eps_high: unclipped pessimistic branch, full gradient
        (0.80, +1.0, True),  # A > 0, s < 1 - eps_low: unclipped, full gradient
        (1.01, +1.0, True),  # inside the range
        (1.01, -1.0, True),
    ],
)
def test_clip_semantics_table(variant, ratio, advantage, gradient_flows):
    # every token carries log(ratio), so s = w_t = ratio; the unnormalised variant uses one token (S = s)
    length = 1 if variant == "seq_ratio_unnormalized" else 3
    old_log_probs = torch.full((1, length), -1.0, dtype=torch.float64)
    log_probs = (old_log_probs + math.log(ratio)).requires_grad_()
    is_response_token = torch.ones(1, length, dtype=torch.bool)
    loss, metrics = gspo_loss(log_probs, old_log_probs, torch.tensor([advantage], dtype=torch.float64),
                              is_response_token, eps_low=0.1, eps_high=0.1, variant=variant)
    (grad,) = torch.autograd.grad(loss, log_probs)
    clipped = min(max(ratio, 0.9), 1.1)
    assert loss.item() == pytest.approx(-min(ratio * advantage, clipped * advantage), abs=1e-12)
    expected = -ratio * advantage / length if gradient_flows else 0.0
    torch.testing.assert_close(grad, torch.full((1, length), expected, dtype=torch.float64))
    clip_metric = "clip_frac" if variant in SEQUENCE_CLIP_VARIANTS else "token_clip_frac"
    assert metrics[clip_metric].item() == (0.0 if gradient_flows else 1.0)


def test_padding_rows_only_give_zero_loss_and_gradient():
    for variant in VARIANTS:
        log_probs = torch.full((2, 3), -math.inf, dtype=torch.float64, requires_grad=True)
        old_log_probs = torch.full((2, 3), math.nan, dtype=torch.float64)
        loss, metrics = gspo_loss(log_probs, old_log_probs, torch.ones(2, dtype=torch.float64),
                                  torch.zeros(2, 3, dtype=torch.bool), eps_low=0.2, eps_high=0.2, variant=variant)
        (grad,) = torch.autograd.grad(loss, log_probs)
        assert loss.item() == 0.0 and torch.equal(grad, torch.zeros(2, 3, dtype=torch.float64))
        assert all(torch.isfinite(value) and value.item() == 0.0 for value in metrics.values()), metrics


# ---------------------------------------------------------------------------------------------
# Numerical robustness
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_huge_log_ratios_stay_finite(variant, dtype):
    log_ratios = torch.tensor([[1e4, 1e4, 1e4], [-1e4, -1e4, -1e4], [1e4, -1e4, 3.0], [-1e4, 5.0, 1e4]] * 2,
                              dtype=dtype)
    advantages = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0], dtype=dtype)
    old_log_probs = torch.full_like(log_ratios, -2.0)
    log_probs = (old_log_probs + log_ratios).requires_grad_()
    entropy = torch.ones_like(log_ratios, requires_grad=True)
    is_response_token = torch.ones_like(log_ratios, dtype=torch.bool)
    loss, metrics = gspo_loss(
        log_probs, old_log_probs, advantages, is_response_token, eps_low=0.2, eps_high=0.2, variant=variant,
        ref_log_probs=old_log_probs - log_ratios, kl_coef=0.1, entropy=entropy, entropy_coef=0.01,
        rollout_log_probs=old_log_probs + log_ratios, mismatch_cap=2.0,
    )
    grad_log_probs, grad_entropy = torch.autograd.grad(loss, [log_probs, entropy])
    assert torch.isfinite(loss)
    assert torch.isfinite(grad_log_probs).all() and torch.isfinite(grad_entropy).all()
    assert all(torch.isfinite(value) for value in metrics.values()), metrics


@pytest.mark.parametrize("log_ratio_per_token", [0.5, -0.5])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_unnormalized_ratio_of_long_sequences_stays_finite(log_ratio_per_token, advantage):
    max_len = 4096  # sum_t log-ratio = +-2048: exp overflows float64 without the clamp
    old_log_probs = torch.full((2, max_len), -1.0)
    log_probs = (old_log_probs + log_ratio_per_token).requires_grad_()
    is_response_token = torch.ones(2, max_len, dtype=torch.bool)
    is_response_token[1, 7:] = False
    loss, _ = gspo_loss(log_probs, old_log_probs, torch.tensor([advantage, advantage]), is_response_token,
                        eps_low=3e-4, eps_high=4e-4, variant="seq_ratio_unnormalized")
    (grad,) = torch.autograd.grad(loss, log_probs)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_normal_range_is_untouched_by_the_clamp():
    """A token log-ratio of 25 is legitimate inside a mean: log s_i must not clamp per token."""
    old_log_probs = torch.tensor([[-30.0, -1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    log_probs = torch.tensor([[-5.0, -7.0, -7.0, -7.0, -7.0]], dtype=torch.float64)  # mean log-ratio 0.2
    log_s = sequence_log_ratio(log_probs, old_log_probs, torch.ones(1, 5, dtype=torch.bool))
    assert log_s.item() == pytest.approx(0.2, abs=1e-12)


def test_half_precision_inputs_compute_in_float32():
    batch = make_batch(7)
    loss, grad, _, metrics = run_loss(batch, "gspo", torch.bfloat16)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert metrics["num_tokens"].item() == batch.is_response_token.sum().item()


# ---------------------------------------------------------------------------------------------
# Denominator and the context-parallel decomposition
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_denominator_replaces_local_count(variant):
    batch = make_batch(8)
    loss, grad, _, metrics = run_loss(batch, variant)
    # the default denominator: the sequences, or the tokens of the token-normalised variants
    num_sequences = metrics["num_tokens" if variant in TOKEN_NORMALIZED_VARIANTS
                            else "num_sequences"].item()
    loss_global, grad_global, _, _ = run_loss(batch, variant, loss_denominator=100.0)
    assert loss_global.item() == pytest.approx(loss.item() * num_sequences / 100.0, abs=1e-12)
    torch.testing.assert_close(grad_global, grad * num_sequences / 100.0, rtol=1e-12, atol=1e-14)


def run_on_two_fake_ranks(batch: Batch, variant: str, is_on_rank0: torch.Tensor, **kwargs):
    """Each "rank" holds the tokens ``response_mask & is_on_rank0`` (resp. ``& ~is_on_rank0``).

    ``sequence_reduce`` is a fake all-reduce: local partial sums + the other rank's (detached) ones,
    so sum forward and identity backward, like the autograd-aware collective. The other rank's sums
    of call k come from the previous pass; three passes are exact for up to two dependent calls.
    """
    masks = [batch.is_response_token & is_on_rank0, batch.is_response_token & ~is_on_rank0]
    previous_sums: list[list[torch.Tensor]] = [[], []]
    for _ in range(3):
        recorded: list[list[torch.Tensor]] = [[], []]
        results = []
        for rank in (0, 1):
            def fake_all_reduce(local_sums_BK, rank=rank):
                call = len(recorded[rank])
                recorded[rank].append(local_sums_BK.detach().clone())
                others = previous_sums[1 - rank]
                return local_sums_BK + (others[call] if call < len(others) else torch.zeros_like(local_sums_BK))
            results.append(run_loss(batch, variant, response_mask=masks[rank], sequence_reduce=fake_all_reduce,
                                    **kwargs))
        previous_sums = recorded
    return results


@pytest.mark.parametrize("optional_terms", [False, True], ids=["plain", "kl_entropy_mismatch"])
@pytest.mark.parametrize("advantage_layout", ["per_sequence", "per_token"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_context_parallel_shards_sum_to_single_process_gradient(variant, advantage_layout, optional_terms):
    batch = make_batch(9, per_token_advantages=advantage_layout == "per_token" and variant in TOKEN_CLIP_VARIANTS)
    if advantage_layout == "per_token" and variant in SEQUENCE_CLIP_VARIANTS:
        # constant per sequence: A_i travels as a token-mean through sequence_reduce
        batch = replace(batch, advantages=batch.advantages[:, None].expand_as(batch.log_probs).clone())
    generator = torch.Generator().manual_seed(10)
    is_on_rank0 = torch.rand(batch.log_probs.shape, generator=generator) < 0.5
    is_on_rank0[3] = True  # every token of row 3 on rank 0: rank 1 sees an empty shard of a real sequence
    is_on_rank0[9] = False  # every token of row 9 on rank 1
    assert batch.is_response_token[3].sum() > 1 and batch.is_response_token[9].sum() > 1

    loss, grad, grad_entropy, metrics = run_loss(batch, variant, optional_terms=optional_terms)
    shards = run_on_two_fake_ranks(batch, variant, is_on_rank0, optional_terms=optional_terms)
    for shard_loss, _, _, shard_metrics in shards:
        assert abs(shard_loss.item() - loss.item()) < 1e-12  # every rank computes the full loss
        assert shard_metrics.keys() == metrics.keys()
        for name, value in metrics.items():
            assert shard_metrics[name].item() == pytest.approx(value.item(), abs=1e-12), name
    torch.testing.assert_close(shards[0][1] + shards[1][1], grad, rtol=1e-12, atol=1e-14)
    assert shards[1][1][3].abs().sum() == 0 and shards[0][1][3].abs().sum() > 0
    if optional_terms:
        torch.testing.assert_close(shards[0][2] + shards[1][2], grad_entropy, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_sequence_reduce_call_per_variant(variant):
    batch = make_batch(11, per_token_advantages=variant in TOKEN_CLIP_VARIANTS)
    calls = []

    def counting_reduce(local_sums_BK):
        calls.append(tuple(local_sums_BK.shape))
        return local_sums_BK

    run_loss(batch, variant, sequence_reduce=counting_reduce, optional_terms=True)
    assert len(calls) == 1 and calls[0][0] == batch.log_probs.shape[0]


def test_sequence_log_ratio_rows_and_reduce():
    batch = make_batch(12)
    log_s = sequence_log_ratio(batch.log_probs, batch.old_log_probs, batch.is_response_token)
    _, _, _, info = run_reference(batch, "gspo")
    torch.testing.assert_close(log_s, torch.tensor([row["log_s"] for row in info], dtype=torch.float64))
    assert log_s[0].item() == 0.0 and log_s[5].item() == 0.0  # padding rows: 0, not NaN
    with pytest.raises(ValueError, match="sequence_reduce returned shape"):
        sequence_log_ratio(batch.log_probs, batch.old_log_probs, batch.is_response_token,
                           sequence_reduce=lambda sums: sums[:, :1])


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_errors_name_the_problem():
    batch = make_batch(13)

    def call(**kwargs):
        arguments = dict(log_probs=batch.log_probs, old_log_probs=batch.old_log_probs, advantages=batch.advantages,
                         response_mask=batch.is_response_token, eps_low=0.2, eps_high=0.2) | kwargs
        return gspo_loss(**arguments)

    with pytest.raises(ValueError, match="unknown variant 'ppo'; valid variants: gspo, gspo_token, grpo, "
                                         "seq_ratio_token_clip, token_ratio_seq_clip, seq_ratio_unnormalized"):
        call(variant="ppo")
    with pytest.raises(ValueError, match="advantages has shape"):
        call(advantages=batch.advantages[:3])
    with pytest.raises(ValueError, match="response_mask has shape"):
        call(response_mask=batch.is_response_token[:, :3])
    with pytest.raises(ValueError, match="old_log_probs has shape"):
        call(old_log_probs=batch.old_log_probs[:3])
    with pytest.raises(ValueError, match="loss_denominator"):
        call(loss_denominator=0.0)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_log_probs"):
        call(kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs entropy"):
        call(entropy_coef=0.1)
    with pytest.raises(ValueError, match="rollout_log_probs needs mismatch_cap"):
        call(rollout_log_probs=batch.old_log_probs)
    with pytest.raises(ValueError, match="eps_low"):
        call(eps_low=-0.1)
    with pytest.raises(ValueError, match=r"variant 'sapo' takes params SapoParams, got GmpoParams"):
        call(variant="sapo", params=GmpoParams())
    with pytest.raises(ValueError, match=r"variant 'gspo' takes params None \(it has no parameters"):
        call(params=SapoParams())
    with pytest.raises(ValueError, match=r"sapo needs params.tau_pos > 0 and params.tau_neg > 0, got 1.0, 0.0"):
        call(variant="sapo", params=SapoParams(tau_neg=0.0))
