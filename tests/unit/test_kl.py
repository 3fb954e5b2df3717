"""The KL term of ``gspo_loss`` against float64 references written here, independently of the loss.

The term is ``+ (kl_coef / D) sum_i (1/n_i) sum_t k3_it`` in the minimised loss, with the k3
estimator ``k3 = exp(x) - x - 1``, ``x = log pi_ref - log pi_theta`` (Schulman's low-variance,
always non-negative estimate of KL(pi_theta || pi_ref)). By hand:

    d k3_it / d lp_it = -exp(x_it) + 1        so    d term / d lp_it = kl_coef (1 - exp(x_it)) / (D n_i)

on response tokens, 0 elsewhere. The KL term's gradient is isolated as the difference of the
gradients with and without it (the policy part is identical in both calls).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.loss.gspo import VARIANTS, gspo_loss
from megatron_gspo.loss.variants import TOKEN_NORMALIZED_VARIANTS

KL_COEF = 0.37


def _case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 0, 4]  # a padding row (n_i = 0) must not count
    B, T = len(lengths), 6
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, T - n:] = True  # responses at the end of the row, after a prompt
    log_probs = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3 - 0.1
    old = log_probs + 0.05 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = log_probs + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    log_probs[~mask] = float("nan")  # outside the mask nothing may leak in
    ref[~mask] = float("-inf")
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2], dtype=torch.float64)
    return log_probs, old, ref, advantages, mask, lengths


def _grad(variant, log_probs, old, ref, advantages, mask, kl_coef, denominator):
    lp = log_probs.clone().requires_grad_()
    loss, metrics = gspo_loss(lp, old, advantages, mask, eps_low=0.2, eps_high=0.28, variant=variant,
                              ref_log_probs=ref, kl_coef=kl_coef, loss_denominator=denominator)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def _independent_kl_term(lp, ref, mask, lengths, kl_coef, denominator, token_sum=False):
    """(kl_coef / D) sum_i (1/n_i) sum_t k3_it, element by element in float64 (no masking tricks);
    ``token_sum``: without the 1/n_i (the token-normalised variants)."""
    total = torch.zeros((), dtype=torch.float64)
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        row = torch.zeros((), dtype=torch.float64)
        for t in range(lp.shape[1]):
            if mask[i, t]:
                x = ref[i, t] - lp[i, t]
                row = row + (torch.exp(x) - x - 1.0)
        total = total + (row if token_sum else row / n)
    return kl_coef * total / denominator


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("denominator", [None, 7.0])
def test_kl_gradient_matches_the_hand_derivative_and_float64_autograd(variant, denominator):
    log_probs, old, ref, advantages, mask, lengths = _case()
    with_kl = _grad(variant, log_probs, old, ref, advantages, mask, KL_COEF, denominator)
    without = _grad(variant, log_probs, old, ref, advantages, mask, 0.0, denominator)
    kl_grad = with_kl[1] - without[1]
    # token-normalised variants (cispo, luspo): each sequence's term counts n_i times and the
    # default denominator is the number of response tokens
    token_normalized = variant in TOKEN_NORMALIZED_VARIANTS
    units = sum(lengths) if token_normalized else sum(n > 0 for n in lengths)
    D = float(units) if denominator is None else denominator

    # by hand
    expected = torch.zeros_like(kl_grad)
    for i, n in enumerate(lengths):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                x = float(ref[i, t] - log_probs[i, t])
                per_token = KL_COEF * (1.0 - torch.exp(torch.tensor(x, dtype=torch.float64)))
                expected[i, t] = per_token / D if token_normalized else per_token / (D * n)
    torch.testing.assert_close(kl_grad, expected, rtol=0, atol=1e-12)

    # float64 autograd through the independent formula
    lp = torch.where(mask, log_probs, 0.0).clone().requires_grad_()
    term = _independent_kl_term(lp, torch.where(mask, ref, 0.0), mask, lengths, KL_COEF, D,
                                token_sum=token_normalized)
    (autograd_grad,) = torch.autograd.grad(term, lp)
    torch.testing.assert_close(kl_grad, torch.where(mask, autograd_grad, 0.0), rtol=0, atol=1e-12)

    # the value: loss(with) - loss(without) is the term; kl_mean is mean_i KL_i
    torch.testing.assert_close(with_kl[0] - without[0], term.detach(), rtol=0, atol=1e-12)
    per_sequence = [float(_independent_kl_term(lp.detach(), torch.where(mask, ref, 0.0), mask,
                                               [n if j == i else 0 for j, n in enumerate(lengths)],
                                               1.0, 1.0)) for i in range(len(lengths))]
    kl_mean = sum(per_sequence) / sum(n > 0 for n in lengths)
    assert abs(float(with_kl[2]["kl_mean"]) - kl_mean) < 1e-12
    assert kl_mean > 1e-3  # the case is not trivially at KL = 0


def test_kl_is_zero_with_zero_gradient_when_the_policy_is_the_reference():
    log_probs, old, _, advantages, mask, _ = _case(seed=3)
    ref = log_probs.clone()
    with_kl = _grad("gspo", log_probs, old, ref, advantages, mask, KL_COEF, None)
    without = _grad("gspo", log_probs, old, ref, advantages, mask, 0.0, None)
    assert float(with_kl[2]["kl_mean"]) == 0.0
    assert torch.equal(with_kl[1], without[1])
