"""Choosing GSPO's sequence clip range (eps_low, eps_high) for a target clip fraction (pure torch).

GSPO's objective per sequence is ``min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``: the
clipped branch (no gradient) is taken when

    A_i > 0 and s_i > 1 + eps_high       ("high": ``gspo_loss``'s clip_frac_high)
    A_i < 0 and s_i < 1 - eps_low        ("low": clip_frac_low)

and never for A_i = 0. The **clip fraction** here is what ``gspo_loss`` logs as ``clip_frac``:
the clipped sequences over ALL the sequences given (zero-advantage ones included, as they are
in the training batch), low + high.

Given measured (s_i, A_i), :func:`calibrate_clip_range` returns the range that clips the target
fraction ``f`` of them. With N sequences it clips exactly ``k = floor(f N)`` (when no two
candidates tie): the smallest range that clips at most the target. Two ways to split between the
sides:

* ``split="ratio"`` (default): keep the ratio eps_high / eps_low of a reference range (the
  configured one; the paper's 4e-4 / 3e-4 keeps "clip higher"). Both eps scale with one factor
  c: sequence i is clipped iff c < b_i, with the breakpoint b_i = (s_i - 1) / eps_high_ref for
  A_i > 0, s_i > 1 and b_i = (1 - s_i) / eps_low_ref for A_i < 0, s_i < 1 (others: never).
  The clipped count is #{b_i > c}, non-increasing in c, so c = the (k+1)-th largest breakpoint.
* ``split="equal"``: half the target on each side, independently: eps_high is the
  (k_h+1)-th largest s_i - 1 over the A > 0 sequences, k_h = floor(k / 2), eps_low the
  (k_l+1)-th largest 1 - s_i over the A < 0 ones, k_l = k - k_h.

A target that cannot be met (fewer candidates than k + 1: with s_i on the "harmless" side of 1
nothing can clip them) is a ValueError saying the largest fraction that can be clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Split = Literal["ratio", "equal"]
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)


@dataclass(frozen=True)
class ClipCalibration:
    eps_low: float
    eps_high: float
    clip_frac_low: float
    """Fraction of all sequences with A < 0 and s < 1 - eps_low under the returned range."""
    clip_frac_high: float
    clip_frac: float
    num_sequences: int
    max_clip_frac: float
    """The largest fraction any range could clip (the candidates: A > 0 with s > 1, A < 0 with
    s < 1)."""


def clip_fractions(seq_ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float
                   ) -> tuple[float, float]:
    """(low, high) fractions of all sequences that GSPO clips under (eps_low, eps_high)."""
    s, a = _checked(seq_ratio, advantages)
    low = ((a < 0) & (s < 1.0 - eps_low)).double().mean()
    high = ((a > 0) & (s > 1.0 + eps_high)).double().mean()
    return float(low), float(high)


def _checked(seq_ratio: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor]:
    s = torch.as_tensor(seq_ratio, dtype=torch.float64).reshape(-1)
    a = torch.as_tensor(advantages, dtype=torch.float64).reshape(-1)
    if s.numel() != a.numel() or s.numel() == 0:
        raise ValueError(f"{s.numel()} sequence ratios for {a.numel()} advantages")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError("sequence ratios must be finite and positive")
    return s, a


def _kth_largest(values: Tensor, k: int, what: str, total: int, target: float) -> float:
    """The (k+1)-th largest of ``values`` (so that exactly k are larger, without ties)."""
    if values.numel() < k + 1:
        raise ValueError(f"target clip fraction {target:g} is not reachable: at most "
                         f"{values.numel()}/{total} = {values.numel() / total:.3g} of the "
                         f"sequences can be clipped {what}")
    return float(torch.sort(values, descending=True).values[k])


def calibrate_clip_range(seq_ratio: Tensor, advantages: Tensor, target_clip_frac: float, *,
                         split: Split = "ratio", eps_low_ref: float = 3e-4,
                         eps_high_ref: float = 4e-4) -> ClipCalibration:
    """(eps_low, eps_high) that clip ``target_clip_frac`` of the sequences (module docstring)."""
    if not 0 < target_clip_frac < 1:
        raise ValueError(f"target clip fraction must be in (0, 1), got {target_clip_frac}")
    s, a = _checked(seq_ratio, advantages)
    n = s.numel()
    k = int(math.floor(target_clip_frac * n + 1e-9))
    high_gap = (s - 1.0)[(a > 0) & (s > 1.0)]
    low_gap = (1.0 - s)[(a < 0) & (s < 1.0)]
    max_frac = (high_gap.numel() + low_gap.numel()) / n
    if split == "ratio":
        if not (eps_low_ref > 0 and eps_high_ref > 0):
            raise ValueError("the reference range must be positive")
        breakpoints = torch.cat([high_gap / eps_high_ref, low_gap / eps_low_ref])
        c = _kth_largest(breakpoints, k, "on either side", n, target_clip_frac)
        eps_low, eps_high = c * eps_low_ref, c * eps_high_ref
        # c * eps_ref can round below a gap equal to c * eps_ref (ties: identical responses have
        # identical s_i), which would clip them too: widen by ulps until at most k are clipped
        for _ in range(64):
            low, high = clip_fractions(s, a, eps_low, eps_high)
            if round((low + high) * n) <= k:
                break
            c = math.nextafter(c, math.inf) * (1 + 1e-15)
            eps_low, eps_high = c * eps_low_ref, c * eps_high_ref
    elif split == "equal":
        k_high = k // 2
        eps_high = _kth_largest(high_gap, k_high, "above 1 + eps_high with A > 0", n,
                                target_clip_frac)
        eps_low = _kth_largest(low_gap, k - k_high, "below 1 - eps_low with A < 0", n,
                               target_clip_frac)
    else:
        raise ValueError(f"split must be 'ratio' or 'equal', got {split!r}")
    if not (eps_low > 0 and eps_high > 0):
        raise ValueError("target clip fraction is not reachable with a positive range: too many "
                         "sequences have s_i exactly 1")
    low, high = clip_fractions(s, a, eps_low, eps_high)
    return ClipCalibration(eps_low=eps_low, eps_high=eps_high, clip_frac_low=low,
                           clip_frac_high=high, clip_frac=low + high, num_sequences=n,
                           max_clip_frac=max_frac)


def ratio_quantiles(seq_ratio: Tensor, qs=QUANTILES) -> dict[float, float]:
    """Quantiles of s_i (float64, linear interpolation)."""
    s = torch.as_tensor(seq_ratio, dtype=torch.float64).reshape(-1)
    values = torch.quantile(s, torch.tensor(qs, dtype=torch.float64))
    return {float(q): float(v) for q, v in zip(qs, values)}
