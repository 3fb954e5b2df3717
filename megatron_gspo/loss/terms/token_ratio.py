"""The variants PPO-clipped per token by the token ratio w_it: grpo, seq_ratio_token_clip
(formulas in :mod:`megatron_gspo.loss.gspo`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from megatron_gspo.loss.terms.common import (CutStats, SequenceInputs, TokenInputs, clip, ppo_cut,
                                             ppo_objective)


def _token_cuts(tokens: TokenInputs, token_ratio_BT: Tensor, eps_low: float,
                eps_high: float) -> tuple[Tensor, dict[str, Tensor]]:
    """``(is_cut_BT, cut counts)``: the cut decision is per token, by its own w_it and A_it."""
    is_cut_low_BT, is_cut_high_BT = ppo_cut(token_ratio_BT, tokens.advantages_BT, eps_low, eps_high)
    is_cut_low_BT = is_cut_low_BT & tokens.is_response_token_BT
    is_cut_high_BT = is_cut_high_BT & tokens.is_response_token_BT
    cut_counts = {"num_cut_low_tokens": tokens.count(is_cut_low_BT),
                  "num_cut_high_tokens": tokens.count(is_cut_high_BT)}
    return is_cut_low_BT | is_cut_high_BT, cut_counts


def _cut_counts(sequences: SequenceInputs) -> CutStats:
    return sequences.sums["num_cut_low_tokens"].detach(), sequences.sums["num_cut_high_tokens"].detach()


def grpo_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: Any) -> dict[str, Tensor]:
    """grpo: sum_t PPO(w_it, A_it) and the cut counts."""
    token_ratio_BT = tokens.token_ratio()
    is_cut_BT, cut_counts = _token_cuts(tokens, token_ratio_BT, eps_low, eps_high)
    objective_BT = ppo_objective(token_ratio_BT, tokens.advantages_BT, is_cut_BT, eps_low, eps_high)
    return {"token_objective_sum": tokens.masked_sum(objective_BT)} | cut_counts


def token_mean(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    """grpo and cispo (cispo's n_i J_i is ``gspo_loss``'s token normalisation): the token-mean of
    the per-token objective."""
    return sequences.sums["token_objective_sum"] / sequences.num_tokens_safe_B, _cut_counts(sequences)


def seq_ratio_token_clip_sums(tokens: TokenInputs, eps_low: float, eps_high: float,
                              params: Any) -> dict[str, Tensor]:
    """seq_ratio_token_clip: the uncut tokens' sg[s_i] exp(lp - sg[lp]) A_it with sg[s_i] factored
    out of the sum, and the cut tokens' constant clip(w_it) A_it."""
    token_ratio_BT, advantages_BT = tokens.token_ratio(), tokens.advantages_BT
    is_cut_BT, cut_counts = _token_cuts(tokens, token_ratio_BT, eps_low, eps_high)
    return {
        "uncut_advantage_sum": tokens.masked_sum(advantages_BT * tokens.unit_weight(),
                                                 tokens.is_response_token_BT & ~is_cut_BT),
        "cut_objective_sum": tokens.masked_sum(clip(token_ratio_BT, eps_low, eps_high).detach() * advantages_BT,
                                               is_cut_BT),
    } | cut_counts


def seq_ratio_token_clip(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    uncut_B = sequences.seq_ratio().detach() * sequences.sums["uncut_advantage_sum"]
    objective_B = (uncut_B + sequences.sums["cut_objective_sum"]) / sequences.num_tokens_safe_B
    return objective_B, _cut_counts(sequences)
