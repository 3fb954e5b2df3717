"""What every variant's term works on: the token inputs, the reduced sums, the PPO clip rule.

A variant is two functions (:class:`VariantTerm`): ``token_sums`` turns the local tokens of a
micro-batch into per-sequence sums ``[B]`` (linear in the tokens, so that ``gspo_loss`` can add
them up across context-parallel ranks in its one ``sequence_reduce`` call), and ``objective``
turns the reduced sums into J_i ``[B]`` and the cut statistics. Notation as in
:mod:`megatron_gspo.loss.gspo`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

# log-ratios are clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] just before each exp
LOG_RATIO_LIMIT = 20.0

CutStats = Optional[tuple[Tensor, Tensor]]
"""``(is_cut_low_B, is_cut_high_B)`` bools for the variants whose cut statistics count sequences,
``(num_cut_low_tokens_B, num_cut_high_tokens_B)`` for those counting tokens, None for sapo."""


@dataclass(frozen=True)
class TokenInputs:
    """The local tokens of a micro-batch, 0 outside the response mask, in the compute dtype."""

    log_probs_BT: Tensor
    log_ratio_BT: Tensor
    advantages_BT: Tensor
    is_response_token_BT: Tensor

    def masked_sum(self, values_BT: Tensor, is_included_BT: Tensor | None = None) -> Tensor:
        """``[B]`` sums of ``values_BT`` over the included tokens (default: the response tokens)."""
        mask_BT = self.is_response_token_BT if is_included_BT is None else is_included_BT
        return torch.where(mask_BT, values_BT, 0.0).sum(-1)

    def count(self, is_counted_BT: Tensor) -> Tensor:
        """``[B]`` numbers of True per row, in the compute dtype, detached."""
        return is_counted_BT.sum(-1).to(self.log_ratio_BT.dtype).detach()

    def unit_weight(self) -> Tensor:
        """``exp(lp - sg[lp])``: value 1, gradient 1 w.r.t. lp_it ("pi_theta / sg[pi_theta]")."""
        return torch.exp(self.log_probs_BT - self.log_probs_BT.detach())

    def token_ratio(self) -> Tensor:
        """w_it = exp(lp_it - old_it), the log-ratio clamped first."""
        return torch.exp(self.log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


@dataclass(frozen=True)
class SequenceInputs:
    """The reduced (exact, over all ranks) per-sequence sums and what ``gspo_loss`` derived."""

    sums: dict[str, Tensor]
    log_ratio_seq_B: Tensor
    """log s_i = (1/n_i) sum_t (lp_it - old_it)."""
    advantages_B: Tensor | None
    """A_i; None for the token-clip variants given per-token advantages."""
    num_tokens_safe_B: Tensor
    """n_i, at least 1."""

    def seq_ratio(self) -> Tensor:
        """s_i = exp(log s_i), the log clamped first."""
        return torch.exp(self.log_ratio_seq_B.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


TokenSums = Callable[[TokenInputs, float, float, Any], dict[str, Tensor]]
Objective = Callable[[SequenceInputs, float, float], tuple[Tensor, CutStats]]


@dataclass(frozen=True)
class VariantTerm:
    """One variant's math: ``token_sums(tokens, eps_low, eps_high, params)`` -> the local sums it
    needs besides n_i and sum_t (lp - old); ``objective(sequences, eps_low, eps_high)`` ->
    ``(J_B, cut statistics)``."""

    token_sums: TokenSums
    objective: Objective
    eps_low_limit: float | None = None
    """The largest eps_low the variant accepts (inclusive); None: ``eps_low < 1`` (a ratio range)."""
    check_params: Callable[[Any], None] | None = None
    """Raises ValueError for invalid ``params`` (the variant's ``VariantSpec.params`` instance)."""


def no_token_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: Any) -> dict[str, Tensor]:
    """The variants whose J_i needs nothing besides n_i and sum_t (lp - old)."""
    return {}


def clip(ratio: Tensor, eps_low: float, eps_high: float) -> Tensor:
    return ratio.clamp(1.0 - eps_low, 1.0 + eps_high)


def ppo_cut(ratio: Tensor, advantage: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """``(is_cut_low, is_cut_high)``: (A < 0 and r < 1 - eps_low), (A > 0 and r > 1 + eps_high)."""
    return (advantage < 0) & (ratio < 1.0 - eps_low), (advantage > 0) & (ratio > 1.0 + eps_high)


def ppo_objective(ratio: Tensor, advantage: Tensor, is_cut: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``min(r A, clip(r) A)``: the constant ``clip(r) A`` where cut, ``r A`` (with gradient) elsewhere."""
    return torch.where(is_cut, clip(ratio, eps_low, eps_high).detach() * advantage, ratio * advantage)
