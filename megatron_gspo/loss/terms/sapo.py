"""sapo (arXiv 2511.20347): a sigmoid soft gate (4/tau) sigma(tau (w_it - 1)) on every token
instead of a hard clip, tau by the advantage's sign (``variants.SapoParams``)."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_gspo.loss.terms.common import CutStats, SequenceInputs, TokenInputs
from megatron_gspo.loss.variants import SapoParams


def check_params(params: SapoParams) -> None:
    if not (params.tau_pos > 0 and params.tau_neg > 0):
        raise ValueError(f"sapo needs params.tau_pos > 0 and params.tau_neg > 0, got {params.tau_pos}, "
                         f"{params.tau_neg}")


def token_sums(tokens: TokenInputs, eps_low: float, eps_high: float, params: SapoParams) -> dict[str, Tensor]:
    """f(w) = (4 / tau) sigmoid(tau (w - 1)): value f(w) A, gradient 4 sigma (1 - sigma) w A grad lp;
    the gate's gradient weight 4 sigma (1 - sigma) for the metrics. No clip range (eps unused)."""
    log_ratio_BT = tokens.log_ratio_BT
    token_ratio_BT = tokens.token_ratio()
    taus = [torch.tensor(t, dtype=log_ratio_BT.dtype, device=log_ratio_BT.device)
            for t in (params.tau_pos, params.tau_neg)]
    tau_BT = torch.where(tokens.advantages_BT > 0, *taus)
    gate_BT = torch.sigmoid(tau_BT * (token_ratio_BT - 1.0))
    weight_BT = (4.0 * gate_BT * (1.0 - gate_BT)).detach()
    return {"token_objective_sum": tokens.masked_sum(4.0 / tau_BT * gate_BT * tokens.advantages_BT),
            "gate_weight_sum": tokens.masked_sum(weight_BT),
            "num_low_gate_tokens": tokens.masked_sum((weight_BT < 0.5).to(log_ratio_BT.dtype))}


def objective(sequences: SequenceInputs, eps_low: float, eps_high: float) -> tuple[Tensor, CutStats]:
    """J_i = (1/n_i) sum_t f(w_it) A_it; no cut statistics (``gspo_loss`` reports the gate's)."""
    return sequences.sums["token_objective_sum"] / sequences.num_tokens_safe_B, None
