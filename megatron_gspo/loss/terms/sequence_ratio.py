"""The variants PPO-clipped by a sequence ratio: gspo, luspo, seq_ratio_unnormalized,
token_ratio_seq_clip, gspo_token (formulas in :mod:`megatron_gspo.loss.gspo`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megatron_gspo.loss.terms.common import (LOG_RATIO_LIMIT, CutStats, SequenceInputs, TokenInputs, clip,
                                             ppo_cut, ppo_objective)


def ppo_on_seq_ratio(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    """gspo and luspo (luspo's n_i J_i is ``gspo_loss``'s token normalisation): PPO(s_i, A_i)."""
    return _ppo_on(sequences.seq_ratio(), sequences.advantages_B, eps_low, eps_high)


def ppo_on_unnormalized_ratio(sequences: SequenceInputs, eps_low: float,
                              eps_high: float) -> tuple[Tensor, CutStats]:
    """seq_ratio_unnormalized: PPO(S_i, A_i), S_i = exp(sum_t (lp_it - old_it))."""
    seq_ratio_B = torch.exp(sequences.sums["log_ratio_sum"].clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    return _ppo_on(seq_ratio_B, sequences.advantages_B, eps_low, eps_high)


def _ppo_on(seq_ratio_B: Tensor, advantages_B: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    is_cut_low_B, is_cut_high_B = ppo_cut(seq_ratio_B, advantages_B, eps_low, eps_high)
    objective_B = ppo_objective(seq_ratio_B, advantages_B, is_cut_low_B | is_cut_high_B, eps_low, eps_high)
    return objective_B, (is_cut_low_B, is_cut_high_B)


def token_ratio_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: Any) -> dict[str, Tensor]:
    """token_ratio_seq_clip: sum_t w_it, the uncut sequence's weight."""
    return {"token_ratio_sum": tokens.masked_sum(tokens.token_ratio())}


def token_ratio_seq_clip(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    """clip(s_i) A_i if the sequence is cut by s_i, else (1/n_i) sum_t w_it A_i."""
    seq_ratio_B, advantages_B = sequences.seq_ratio(), sequences.advantages_B
    is_cut_low_B, is_cut_high_B = ppo_cut(seq_ratio_B, advantages_B, eps_low, eps_high)
    uncut_B = advantages_B * sequences.sums["token_ratio_sum"] / sequences.num_tokens_safe_B
    cut_B = clip(seq_ratio_B, eps_low, eps_high).detach() * advantages_B
    return torch.where(is_cut_low_B | is_cut_high_B, cut_B, uncut_B), (is_cut_low_B, is_cut_high_B)


def gspo_token_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: Any) -> dict[str, Tensor]:
    """gspo_token: all tokens share the ratio value s_i, so whether token t is cut depends only on
    the sign of A_it; the sums are split by sign and stay linear (``gspo``'s module docstring)."""
    unit_weight_BT = tokens.unit_weight()
    advantages_BT, is_response_token_BT = tokens.advantages_BT, tokens.is_response_token_BT
    is_positive_BT = is_response_token_BT & (advantages_BT > 0)
    is_negative_BT = is_response_token_BT & (advantages_BT < 0)
    return {
        "positive_advantage_sum": tokens.masked_sum(advantages_BT * unit_weight_BT, is_positive_BT),
        "negative_advantage_sum": tokens.masked_sum(advantages_BT * unit_weight_BT, is_negative_BT),
        "num_positive_advantage_tokens": tokens.count(is_positive_BT),
        "num_negative_advantage_tokens": tokens.count(is_negative_BT),
    }


def gspo_token(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    """(1/n_i) sum_t PPO(s_it, A_it): positive-advantage tokens are cut when s_i > 1 + eps_high,
    negative ones when s_i < 1 - eps_low."""
    seq_ratio_B, sums = sequences.seq_ratio(), sequences.sums
    is_cut_high_B = seq_ratio_B > 1.0 + eps_high
    is_cut_low_B = seq_ratio_B < 1.0 - eps_low
    clipped_ratio_B = clip(seq_ratio_B, eps_low, eps_high).detach()
    positive_sum_B, negative_sum_B = sums["positive_advantage_sum"], sums["negative_advantage_sum"]
    positive_B = torch.where(is_cut_high_B, clipped_ratio_B * positive_sum_B.detach(),
                             seq_ratio_B.detach() * positive_sum_B)
    negative_B = torch.where(is_cut_low_B, clipped_ratio_B * negative_sum_B.detach(),
                             seq_ratio_B.detach() * negative_sum_B)
    objective_B = (positive_B + negative_B) / sequences.num_tokens_safe_B
    num_cut_low_tokens_B = is_cut_low_B * sums["num_negative_advantage_tokens"]
    num_cut_high_tokens_B = is_cut_high_B * sums["num_positive_advantage_tokens"]
    return objective_B, (num_cut_low_tokens_B.detach(), num_cut_high_tokens_B.detach())
