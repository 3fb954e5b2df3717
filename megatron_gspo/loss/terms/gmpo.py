"""gmpo (arXiv 2507.20673): A_i times the geometric mean of the token ratios, each clipped in log
space by PPO's min per token (gmpo's own range, ``variants.GmpoParams``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megatron_gspo.loss.terms.common import LOG_RATIO_LIMIT, CutStats, SequenceInputs, TokenInputs

# a log-space range: any eps_low >= 0
EPS_LOW_LIMIT = math.inf


def token_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: Any) -> dict[str, Tensor]:
    """sum_t l~_it: by the sign of the (per-sequence) advantage, a positive-advantage token is cut
    above eps_high, a negative one below -eps_low; a cut token keeps the clamped value and no
    gradient."""
    log_ratio_BT, advantages_BT = tokens.log_ratio_BT, tokens.advantages_BT
    is_cut_high_BT = tokens.is_response_token_BT & (advantages_BT > 0) & (log_ratio_BT > eps_high)
    is_cut_low_BT = tokens.is_response_token_BT & (advantages_BT < 0) & (log_ratio_BT < -eps_low)
    clipped_BT = torch.where(is_cut_low_BT | is_cut_high_BT,
                             log_ratio_BT.clamp(-eps_low, eps_high).detach(), log_ratio_BT)
    return {"clipped_log_ratio_sum": tokens.masked_sum(clipped_BT),
            "num_cut_low_tokens": tokens.count(is_cut_low_BT),
            "num_cut_high_tokens": tokens.count(is_cut_high_BT)}


def objective(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    """J_i = A_i exp((1/n_i) sum_t l~_it)."""
    sums = sequences.sums
    log_mean_B = (sums["clipped_log_ratio_sum"] / sequences.num_tokens_safe_B).clamp(-LOG_RATIO_LIMIT,
                                                                                     LOG_RATIO_LIMIT)
    return (sequences.advantages_B * torch.exp(log_mean_B),
            (sums["num_cut_low_tokens"].detach(), sums["num_cut_high_tokens"].detach()))
