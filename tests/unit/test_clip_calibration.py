"""``megatron_gspo.loss.clip_calibration`` against a synthetic s_i distribution with a known answer.

log s_i ~ Normal(mu, sigma), independent of the advantage's sign (A > 0 with probability p,
A < 0 with q, A = 0 otherwise). The population answer, from the normal CDF (stdlib
``statistics.NormalDist``, float64):

* equal split: p P(s > 1 + eps_high) = f / 2  =>  eps_high = exp(mu + sigma z_{1 - f/(2p)}) - 1,
  q P(s < 1 - eps_low) = f / 2  =>  eps_low = 1 - exp(mu + sigma z_{f/(2q)});
* ratio split (eps = c (l, h)): p (1 - Phi((log(1 + c h) - mu) / sigma))
  + q Phi((log(1 - c l) - mu) / sigma) = f, solved for c by bisection.

On 400 000 samples the calibrated range must be within 2% of the population answer (the
quantile's sampling error is ~0.3% here), and on the samples themselves it must clip exactly
floor(f N) sequences (no ties in continuous samples).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from megatron_gspo.loss.clip_calibration import (calibrate_clip_range, clip_fractions,
                                                 ratio_quantiles)

MU, SIGMA, P, Q, N = 0.001, 0.02, 0.45, 0.4, 400_000
PHI = NormalDist()


def samples(seed=0):
    gen = torch.Generator().manual_seed(seed)
    s = torch.exp(MU + SIGMA * torch.randn(N, generator=gen, dtype=torch.float64))
    u = torch.rand(N, generator=gen, dtype=torch.float64)
    a = torch.where(u < P, 1.0, torch.where(u < P + Q, -1.0, 0.0))
    return s, a


def population_fraction(eps_low, eps_high):
    high = P * (1 - PHI.cdf((math.log(1 + eps_high) - MU) / SIGMA))
    low = Q * PHI.cdf((math.log(1 - eps_low) - MU) / SIGMA) if eps_low < 1 else 0.0
    return low + high


@pytest.mark.parametrize("target", [0.05, 0.10, 0.15])
def test_equal_split_matches_the_lognormal_quantiles(target):
    s, a = samples()
    got = calibrate_clip_range(s, a, target, split="equal")
    eps_high = math.exp(MU + SIGMA * PHI.inv_cdf(1 - target / (2 * P))) - 1
    eps_low = 1 - math.exp(MU + SIGMA * PHI.inv_cdf(target / (2 * Q)))
    assert got.eps_high == pytest.approx(eps_high, rel=0.02)
    assert got.eps_low == pytest.approx(eps_low, rel=0.02)
    k = math.floor(target * N)
    assert got.clip_frac == pytest.approx(k / N, abs=0.5 / N)
    assert got.clip_frac_high == pytest.approx((k // 2) / N, abs=0.5 / N)
    assert got.num_sequences == N and got.max_clip_frac == pytest.approx(
        float((((a > 0) & (s > 1)) | ((a < 0) & (s < 1))).double().mean()))


@pytest.mark.parametrize("target", [0.05, 0.10, 0.15])
def test_ratio_split_keeps_the_reference_ratio_and_solves_the_population_equation(target):
    s, a = samples(1)
    low_ref, high_ref = 3e-4, 4e-4
    got = calibrate_clip_range(s, a, target, split="ratio", eps_low_ref=low_ref,
                               eps_high_ref=high_ref)
    assert got.eps_high / got.eps_low == pytest.approx(high_ref / low_ref, rel=1e-12)
    lo, hi = 0.0, 0.99 / low_ref  # bisection on c: the population fraction decreases in c
    for _ in range(200):
        mid = (lo + hi) / 2
        if population_fraction(mid * low_ref, mid * high_ref) > target:
            lo = mid
        else:
            hi = mid
    assert got.eps_low == pytest.approx(lo * low_ref, rel=0.02)
    assert got.clip_frac == pytest.approx(math.floor(target * N) / N, abs=0.5 / N)
    assert population_fraction(got.eps_low, got.eps_high) == pytest.approx(target, rel=0.02)


def test_small_exact_case_and_the_sign_rule():
    # A > 0 is clipped only above 1 + eps_high, A < 0 only below 1 - eps_low, A = 0 never
    s = torch.tensor([1.5, 1.2, 0.7, 0.9, 1.4, 0.5, 1.05, 0.95, 3.0, 0.1],
                     dtype=torch.float64)
    a = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 0.0, 0.0])
    # ratio split with reference (0.1, 0.1): breakpoints 5, 2, 3, 1, 0.5, 0.5 -> 2 of 10 clipped
    got = calibrate_clip_range(s, a, 0.2, split="ratio", eps_low_ref=0.1, eps_high_ref=0.1)
    assert got.eps_low == pytest.approx(0.2) and got.eps_high == pytest.approx(0.2)
    assert (got.clip_frac_low, got.clip_frac_high) == (pytest.approx(0.1), pytest.approx(0.1))
    assert clip_fractions(s, a, 0.25, 0.25) == (pytest.approx(0.1), pytest.approx(0.1))
    assert got.max_clip_frac == pytest.approx(0.6)
    with pytest.raises(ValueError, match="at most 6/10 = 0.6"):
        calibrate_clip_range(s, a, 0.7)
    with pytest.raises(ValueError, match="must be in"):
        calibrate_clip_range(s, a, 0.0)


def test_quantiles():
    s, _ = samples(2)
    q = ratio_quantiles(s)
    for level, value in q.items():
        assert value == pytest.approx(math.exp(MU + SIGMA * PHI.inv_cdf(level)), rel=2e-3)
