"""Test-only GSPO references for the distributed loss tests.

* :func:`naive_loss` — a per-sequence Python loop in float64 over the GLOBAL batch: the ground truth.
  It applies the PPO cut rule from docs/gspo_math.md literally (cut unit = constant ``clip(r) A``).
* :func:`rowwise_loss` — a vectorised loss over per-sequence rows with the same keyword interface as
  ``megatron_gspo.loss.gspo.gspo_loss`` (``loss_denominator``, ``sequence_reduce``), applying
  ``sequence_reduce`` to every ``[S, K]`` tensor of per-sequence partial sums. It stands in for
  ``gspo_loss`` so the distributed plumbing can be tested on its own; the tests also run the real
  ``gspo_loss`` when it exists.
"""

from __future__ import annotations

import torch

VARIANTS = ("gspo", "gspo_token", "grpo")


def _cut(ratio, adv, eps_low, eps_high):
    """PPO rule: the unit is cut (constant, no gradient) when the clip branch is the min."""
    return ((adv > 0) & (ratio > 1 + eps_high)) | ((adv < 0) & (ratio < 1 - eps_low))


def naive_loss(log_probs, old_log_probs, advantages, is_response_token, *, variant, eps_low, eps_high):
    """-(1/N) sum_i J_i over all sequences, N = number of sequences with >= 1 response token.

    Args are ``[S, T]`` rows (log-probs differentiable), ``[S]`` advantages, ``[S, T]`` bool mask.
    """
    total = log_probs.new_zeros(())
    num_sequences = 0
    for i in range(log_probs.shape[0]):
        keep = is_response_token[i]
        if not bool(keep.any()):
            continue
        num_sequences += 1
        lp, old, adv = log_probs[i][keep], old_log_probs[i][keep], advantages[i]
        if variant == "gspo":
            s = torch.exp((lp - old).mean())
            j = torch.clamp(s, 1 - eps_low, 1 + eps_high).detach() * adv if _cut(s, adv, eps_low, eps_high) else s * adv
        elif variant == "gspo_token":
            s = torch.exp((lp - old).mean()).detach()
            terms = []
            for t in range(lp.shape[0]):
                s_t = s * torch.exp(lp[t] - lp[t].detach())
                if _cut(s, adv, eps_low, eps_high):
                    terms.append(torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv)
                else:
                    terms.append(s_t * adv)
            j = torch.stack(terms).mean()
        elif variant == "grpo":
            terms = []
            for t in range(lp.shape[0]):
                w = torch.exp(lp[t] - old[t])
                if _cut(w, adv, eps_low, eps_high):
                    terms.append(torch.clamp(w, 1 - eps_low, 1 + eps_high).detach() * adv)
                else:
                    terms.append(w * adv)
            j = torch.stack(terms).mean()
        else:
            raise ValueError(variant)
        total = total + j
    return -total / num_sequences, num_sequences


def rowwise_loss(log_probs, old_log_probs, advantages, response_mask, *, eps_low, eps_high,
                 variant="gspo", loss_denominator=None, sequence_reduce=None):
    """Vectorised GSPO/GSPO-token/GRPO over rows, with ``sequence_reduce`` on partial sums."""
    reduce = sequence_reduce or (lambda x: x)
    mask = response_mask.to(log_probs.dtype)
    log_ratio = (log_probs - old_log_probs) * mask
    sums_S2 = reduce(torch.stack([log_ratio.sum(-1), mask.sum(-1)], dim=-1))
    count_S = sums_S2[:, 1]
    is_nonempty_S = count_S > 0
    safe_count_S = torch.where(is_nonempty_S, count_S, torch.ones_like(count_S))
    adv_S = advantages
    if variant == "gspo":
        s_S = torch.exp(sums_S2[:, 0] / safe_count_S)
        cut_S = _cut(s_S, adv_S, eps_low, eps_high)
        j_S = torch.where(cut_S, torch.clamp(s_S, 1 - eps_low, 1 + eps_high).detach() * adv_S, s_S * adv_S)
    elif variant == "gspo_token":
        s_S = torch.exp(sums_S2[:, 0] / safe_count_S).detach()
        cut_S = _cut(s_S, adv_S, eps_low, eps_high)
        s_ST = s_S[:, None] * torch.exp(log_probs - log_probs.detach())
        per_token = torch.where(cut_S[:, None], (torch.clamp(s_S, 1 - eps_low, 1 + eps_high) * adv_S)[:, None],
                                s_ST * adv_S[:, None])
        j_S = reduce((per_token * mask).sum(-1, keepdim=True))[:, 0] / safe_count_S
    elif variant == "grpo":
        w_ST = torch.exp(log_probs - old_log_probs)
        cut_ST = _cut(w_ST, adv_S[:, None], eps_low, eps_high)
        per_token = torch.where(cut_ST, torch.clamp(w_ST, 1 - eps_low, 1 + eps_high).detach() * adv_S[:, None],
                                w_ST * adv_S[:, None])
        j_S = reduce((per_token * mask).sum(-1, keepdim=True))[:, 0] / safe_count_S
    else:
        raise ValueError(variant)
    j_S = torch.where(is_nonempty_S, j_S, torch.zeros_like(j_S))
    denominator = loss_denominator if loss_denominator is not None else int(is_nonempty_S.sum())
    return -j_S.sum() / denominator, {}
