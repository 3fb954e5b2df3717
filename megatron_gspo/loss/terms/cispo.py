"""cispo (MiniMax-M1, arXiv 2506.13585): every token's gradient A_it grad lp_it weighted by its IS
weight w_it, clipped to cispo's own range and detached; no token dropped; token-normalised."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from megatron_gspo.loss.terms.common import TokenInputs, clip

# eps_low = 1 is no lower bound on the IS weight
EPS_LOW_LIMIT = 1.0


def token_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: Any) -> dict[str, Tensor]:
    """sg[clip(w)] A_it exp(lp - sg[lp]): value clip(w) A, gradient sg[clip(w)] A grad lp; the clip
    is of the IS weight, on both sides whatever the advantage's sign."""
    token_ratio_BT, is_response_token_BT = tokens.token_ratio(), tokens.is_response_token_BT
    is_low_BT = is_response_token_BT & (token_ratio_BT < 1.0 - eps_low)
    is_high_BT = is_response_token_BT & (token_ratio_BT > 1.0 + eps_high)
    weight_BT = clip(token_ratio_BT, eps_low, eps_high).detach()
    return {"token_objective_sum": tokens.masked_sum(weight_BT * tokens.advantages_BT * tokens.unit_weight()),
            "num_cut_low_tokens": tokens.count(is_low_BT),
            "num_cut_high_tokens": tokens.count(is_high_BT)}
