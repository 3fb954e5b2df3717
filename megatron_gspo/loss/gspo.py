"""GSPO loss math: sequence-level importance ratio, PPO clipping, aggregation (pure torch).

Reference: docs/gspo_math.md (Zheng et al., "Group Sequence Policy Optimization", arXiv
2507.18071). Tensors and floats in, ``(loss, metrics)`` out: no torch.distributed, no config,
no Megatron. The distributed layer passes its collectives in through ``sequence_reduce``.

Shape suffixes
    B  num_sequences: rows of the micro-batch, one response per row (padding rows allowed)
    T  max_len: token positions of a row; ``is_response_token_BT`` is True on response tokens
    K  number of per-sequence partial sums stacked into one ``sequence_reduce`` call

Notation: lp_it = log pi_theta(y_it), old_it = log pi_old(y_it), n_i = |y_i| (response tokens),
A_i (or A_it) the advantage, sg[.] stop-gradient, clip(r) = clamp(r, 1 - eps_low, 1 + eps_high).

    log s_i = (1/n_i) sum_t (lp_it - old_it)          s_i = exp(log s_i)    (geometric mean)
    w_it    = exp(lp_it - old_it)                      token ratio

PPO rule for a unit (sequence or token) with ratio r and advantage A: the unit is CUT when
    (A > 0 and r > 1 + eps_high)  or  (A < 0 and r < 1 - eps_low);
a cut unit contributes the constant clip(r) * A with no gradient, an uncut one r * A. This is
min(r A, clip(r) A) written without a tie: A < 0 with r > 1 + eps_high is NOT cut (pessimistic
bound, full gradient).

Variants (J_i is the per-sequence objective, maximised):
    gspo                    J_i = PPO(s_i, A_i)
    gspo_token              J_i = (1/n_i) sum_t PPO(s_it, A_it),  s_it = sg[s_i] exp(lp_it - sg[lp_it])
                            (value s_i; equals gspo in value and gradient when A_it = A_i)
    grpo                    J_i = (1/n_i) sum_t PPO(w_it, A_it)
    seq_ratio_token_clip    J_i = (1/n_i) sum_t [ clip(w_it) A_it          if token t is cut by w_it
                                              sg[s_i] exp(lp_it - sg[lp_it]) A_it   otherwise ]
    token_ratio_seq_clip    J_i = clip(s_i) A_i if the sequence is cut by s_i, else (1/n_i) sum_t w_it A_i
    seq_ratio_unnormalized  J_i = PPO(S_i, A_i),  S_i = exp(sum_t (lp_it - old_it))   (no 1/n_i)
    cispo (MiniMax-M1, arXiv 2506.13585)
                            J_i = (1/n_i) sum_t sg[clip(w_it)] A_it exp(lp_it - sg[lp_it])
                            (gradient sg[clip(w)] A grad lp: the paper's sg(r^) A log pi; no token
                            dropped; the clip is the IS weight's, [1 - eps_low, 1 + eps_high],
                            eps_low = 1 being no lower bound); token-normalised (below)
    sapo (arXiv 2511.20347) J_i = (1/n_i) sum_t f_it(w_it) A_it,  f(w) = (4/tau) sigmoid(tau (w - 1)),
                            tau = tau_pos if A_it > 0 else tau_neg (a soft gate, no clip: its
                            gradient is 4 sigma (1 - sigma) w A grad lp, the on-policy one at w = 1)
    luspo (arXiv 2602.05261) J_i = PPO(s_i, A_i) as gspo; token-normalised (each sequence's term
                            scaled by its length n_i, against GSPO's length bias)
    gmpo (arXiv 2507.20673) J_i = A_i exp((1/n_i) sum_t l~_it),  l~_it = log w_it except where PPO's
                            min cuts in log space: sg[clamp(log w_it, -eps_low, eps_high)] when
                            A_i > 0 and log w > eps_high, or A_i < 0 and log w < -eps_low
                            (the geometric mean of the token-clipped ratios; eps in log space)
Token-normalised variants (``variants.TOKEN_NORMALIZED_VARIANTS``: cispo, luspo) multiply each
sequence's whole term by n_i, and D is then the number of response tokens (the default; the
distributed caller passes the mini-batch's token count): a mean over tokens, not sequences.
The eps pair is whatever the caller passes. Variants whose clipped ratio is a sequence ratio want
the sequence range (paper: 3e-4 / 4e-4); those that clip the per-token w_it
(``TOKEN_RATIO_CLIP_VARIANTS``: grpo, seq_ratio_token_clip) a token range (0.2 / 0.28). "Token-clip
variant" (``TOKEN_CLIP_VARIANTS``) means the cut unit is the token, which includes gspo_token
(clipped by s_i, so with the sequence range); see ``megatron_gspo.loss.variants``.

Loss (minimised):
    loss = -(1/D) sum_{i: n_i > 0} [ m_i J_i - kl_coef KL_i + entropy_coef H_i ]
    D    = loss_denominator if given, else N = number of rows with n_i > 0
    KL_i = (1/n_i) sum_t k3_it,  k3_it = exp(ref_it - lp_it) - (ref_it - lp_it) - 1   (low-variance KL)
    H_i  = (1/n_i) sum_t entropy_it
    m_i  = sg[ min(exp((1/n_i) sum_t (old_it - rollout_it)), mismatch_cap) ]   (truncated IS weight,
           the MEAN log-ratio, never the sum), 1 when no rollout log-probs are given.

The objective under staleness (docs/gspo_math.md, "The objective under staleness"). With
old_it = the proximal policy (the trainer's weights at the start of the update, recomputed) and
rollout_it = the behaviour policy (the log-prob each token was sampled with, recorded per token, so
the tokens of one sequence may come from several weight versions), the loss above IS the decoupled
GSPO objective: s_i measures the update against the proximal policy and is clipped, m_i (the
behaviour weight) corrects for the behaviour policy, at sequence level with the same 1/n_i as s_i,
truncated at mismatch_cap, detached. The bypass form passes the behaviour log-probs as
old_log_probs and no rollout_log_probs (s_i against the behaviour policy, m_i = 1).

Distributed decomposition (context parallelism). Everything non-linear above is a function of a
few per-sequence sums over tokens: n_i, sum_t (lp - old), and, per variant, sums of local per-token
terms. Each rank computes these sums over its own tokens as one ``[B, K]`` tensor and calls
``sequence_reduce`` on it once; with an autograd-aware all-reduce over the context-parallel group
(sum forward, identity backward) every rank gets the exact sums over all tokens, computes the same
J_i and the same loss, and back-propagates dJ_i/d(sum) into its own tokens only, so the gradients
summed over the CP ranks equal the single-process gradient. Rows count as sequences when the
REDUCED n_i > 0 (a rank may hold no token of a real sequence). Terms that multiply a per-token
factor by sg[s_i] stay linear in a local sum because sg[s_i] is a per-sequence constant and the cut
decision depends only on s_i and the token's own ratio / advantage sign, e.g. for gspo_token
    sum_{t: A_it > 0} PPO(s_it, A_it) = clip(s_i) sg[P_i]  if s_i > 1 + eps_high,  else sg[s_i] P_i
    P_i = sum_{t: A_it > 0} A_it exp(lp_it - sg[lp_it])     (value sum A_it, gradient A_it per token)
so EVERY variant, optional terms included, makes exactly ONE ``sequence_reduce`` call
(``sequence_log_ratio`` also makes one). Each variant's local sums and its J_i from the reduced
sums are the two functions of its ``megatron_gspo.loss.terms.TERMS`` entry; this module has no
per-variant branch beyond the registry's properties (``variants.SPECS``).

Numerics: log-ratios are clamped to [-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT] = [-20, 20] just before
each exp (log s_i, log S_i, per-token log w_it, the k3 argument). exp(20) = 4.9e8 is far outside
any clip range, so in the normal range nothing changes; beyond it a cut unit has no gradient
anyway, and an uncut one (A < 0 with a ratio above e^20, or A > 0 below e^-20) keeps the value at
the clamp and gets zero gradient instead of an overflow. Positions outside the response mask are
replaced by 0 before any arithmetic, so NaN/inf there (e.g. -inf log-probs of padding) never reach
the loss or the gradient. Half-precision inputs are computed in float32.
"""

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron_gspo.loss.advantages import group_advantages
from megatron_gspo.loss.terms import TERMS
from megatron_gspo.loss.terms.common import LOG_RATIO_LIMIT, SequenceInputs, TokenInputs
from megatron_gspo.loss.variants import (SEQUENCE_CLIP_VARIANTS, SPECS, TOKEN_CLIP_VARIANTS,
                                         TOKEN_NORMALIZED_VARIANTS, TOKEN_RATIO_CLIP_VARIANTS,
                                         VARIANTS, Variant)

__all__ = [
    "LOG_RATIO_LIMIT",
    "SEQUENCE_CLIP_VARIANTS",
    "TOKEN_CLIP_VARIANTS",
    "TOKEN_RATIO_CLIP_VARIANTS",
    "VARIANTS",
    "Variant",
    "group_advantages",
    "gspo_loss",
    "sequence_log_ratio",
]

SequenceReduce = Callable[[Tensor], Tensor]


def sequence_log_ratio(
    log_probs: Tensor,
    old_log_probs: Tensor,
    response_mask: Tensor,
    *,
    sequence_reduce: SequenceReduce | None = None,
) -> Tensor:
    """``log s_i = (1/n_i) sum_t (lp_it - old_it)`` per row, ``[B]``; 0 for rows with n_i = 0.

    Args:
        log_probs: ``[B, T]`` log pi_theta of the sampled tokens (gradient flows through it).
        old_log_probs: ``[B, T]`` log pi_old (treated as a constant).
        response_mask: ``[B, T]``, True (or non-zero) on response tokens.
        sequence_reduce: applied once to the ``[B, 2]`` local sums (masked log-ratio sum, token
            count) before dividing; pass an autograd-aware all-reduce under context parallelism.
    """
    is_response_token_BT = _response_mask(response_mask, log_probs.shape)
    dtype = _compute_dtype(log_probs)
    log_ratio_BT = torch.where(is_response_token_BT, log_probs.to(dtype) - old_log_probs.detach().to(dtype), 0.0)
    sums_B2 = torch.stack([log_ratio_BT.sum(-1), is_response_token_BT.sum(-1).to(dtype)], dim=-1)
    sums_B2 = _reduce_sequence_sums(sums_B2, sequence_reduce)
    return sums_B2[:, 0] / sums_B2[:, 1].clamp(min=1.0)


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    eps_low: float,
    eps_high: float,
    variant: Variant = "gspo",
    loss_denominator: float | None = None,
    sequence_reduce: SequenceReduce | None = None,
    ref_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_log_probs: Tensor | None = None,
    mismatch_cap: float | None = None,
    params: Any = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (and ablation) policy loss; formulas, variants and the CP decomposition in the module docstring.

    Args:
        log_probs: ``[B, T]`` log pi_theta of the sampled tokens; the gradient flows through it.
        old_log_probs: ``[B, T]`` log pi_old (constant).
        advantages: ``[B]``, or ``[B, T]`` per token (constant). Token-clip variants (gspo_token,
            grpo, seq_ratio_token_clip) use per-token values as A_it. Sequence-clip variants
            (gspo, token_ratio_seq_clip, seq_ratio_unnormalized) need one advantage per
            sequence: a ``[B, T]`` tensor must be constant over each row's response tokens
            (checked on the local tokens, ValueError otherwise; this check syncs with the host)
            and A_i is then its token-mean through ``sequence_reduce`` (so a CP rank holding no
            token of row i still gets A_i).
        response_mask: ``[B, T]``, True (or non-zero) on response tokens; prompt and padding are
            False. Values of the other tensors outside the mask are ignored (may be NaN/inf).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` for the variant's cut unit
            (``GSPOConfig.clip_range`` picks it: the sequence or the token range, or cispo's /
            gmpo's own; gmpo's is in log space, sapo ignores it).
        variant: one of ``VARIANTS``; its per-token term and J_i are ``terms.TERMS[variant]``.
        loss_denominator: D. None divides by the local N (rows with a response token); the
            distributed caller passes the number of sequences of the whole mini-batch.
        sequence_reduce: called exactly once on the ``[B, K]`` tensor of local per-sequence sums
            (column 0 the response-token count, column 1 the masked log-ratio sum, then the
            variant's and the optional terms' sums) before anything non-linear is computed; must
            return a tensor of the same shape. Default identity. Under context parallelism: an
            all-reduce(SUM) over the CP group whose backward is the identity.
        ref_log_probs, kl_coef: k3 KL to a reference policy (needs ``ref_log_probs`` when
            ``kl_coef != 0``).
        entropy, entropy_coef: ``[B, T]`` per-token entropies (gradient flows through them);
            the bonus subtracts ``entropy_coef * H_i`` per sequence from the loss.
        rollout_log_probs, mismatch_cap: the rollout engine's log-probs (the behaviour policy:
            per token, the log-prob the token was sampled with, whichever weight version that was)
            and the cap C of the detached weight ``m_i = min(exp(mean_t(old - rollout)), C)``
            multiplying J_i (the decoupled objective's behaviour weight, module docstring).
        params: the variant's parameters besides its clip range, an instance of
            ``variants.SPECS[variant].params`` (sapo: ``SapoParams``, its gate temperatures for
            tokens with A_it > 0 / the others); None: that class's defaults. The variants without
            such a class take None only.

    Returns:
        ``(loss, metrics)``: scalar loss; ``metrics`` maps names to detached 0-d tensors (means
        are over this call's rows with n_i > 0, 0 when there are none; to combine calls, weight
        sequence means by ``num_sequences`` and token fractions by ``num_tokens``). Every CP rank
        gets the same values. The key set depends only on the variant and the optional inputs:

        always: ``loss``, ``policy_loss`` (= -(1/D) sum_i m_i J_i), ``num_sequences`` (N),
            ``num_tokens`` (sum_i n_i), ``response_length_mean|min|max``,
            ``log_ratio_seq_mean|std|min|max`` (log s_i, length-normalised for every variant;
            population std)
        sequence-clip variants: ``clip_frac_low``, ``clip_frac_high``, ``clip_frac``: fraction
            of sequences cut on the low side (A < 0, r < 1 - eps_low), the high side (A > 0,
            r > 1 + eps_high), either; r = s_i (S_i for seq_ratio_unnormalized)
        token-clip variants (and gmpo): ``token_clip_frac_low``, ``token_clip_frac_high``,
            ``token_clip_frac``: the same as fractions of response tokens (cispo: tokens whose IS
            weight was clipped, w < 1 - eps_low / w > 1 + eps_high, whatever the advantage; gmpo:
            tokens whose log-ratio was cut, A_i < 0 and log w < -eps_low / A_i > 0 and
            log w > eps_high); sapo has no clip: ``sapo_gate_weight_mean`` (token-mean of the
            gate's gradient weight 4 sigma (1 - sigma) relative to the on-policy gradient, 1 at
            w = 1) and ``sapo_gate_weight_low_frac`` (fraction of tokens below 0.5)
        token-normalised variants (cispo, luspo): ``loss`` and ``policy_loss`` are the sums as
            above with each sequence's term multiplied by n_i (D is then a token count)
        with ref_log_probs: ``kl_mean`` (mean_i KL_i); with entropy: ``entropy_mean`` (mean_i H_i)
        with rollout_log_probs: ``mismatch_weight_mean`` (mean_i m_i), ``mismatch_weight_max``
            (max_i m_i), ``mismatch_weight_ess`` (the normalised effective sample size of the
            weights as applied, (sum_i m_i)^2 / (N sum_i m_i^2), in [1/N, 1]; 0 when N = 0),
            ``mismatch_capped_frac`` (fraction with exp(mean) > cap),
            ``mismatch_log_prob_abs_diff_mean`` (token-mean of |old - rollout|)
    """
    params = _variant_params(variant, params)
    _check_options(variant, eps_low, eps_high, loss_denominator, ref_log_probs, kl_coef, entropy, entropy_coef,
                   rollout_log_probs, mismatch_cap, params)
    term = TERMS[variant]
    dtype = _compute_dtype(log_probs)
    is_response_token_BT = _response_mask(response_mask, log_probs.shape)
    _check_shapes(log_probs, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, entropy=entropy,
                  rollout_log_probs=rollout_log_probs)
    log_probs_BT = _masked(log_probs, is_response_token_BT, dtype)
    old_log_probs_BT = _masked(old_log_probs.detach(), is_response_token_BT, dtype)
    log_ratio_BT = log_probs_BT - old_log_probs_BT
    advantages_B, advantages_BT = _split_advantages(advantages, is_response_token_BT, variant, dtype)

    # ---- local per-sequence sums: the only place tokens are aggregated -------------------------
    tokens = TokenInputs(log_probs_BT, log_ratio_BT, advantages_BT, is_response_token_BT)
    local_sums = _local_sequence_sums(
        term.token_sums(tokens, eps_low, eps_high, params), tokens, old_log_probs_BT, dtype,
        advantage_sum=advantages_B is None and variant in SEQUENCE_CLIP_VARIANTS,
        ref_log_probs=ref_log_probs, entropy=entropy, rollout_log_probs=rollout_log_probs)
    names = list(local_sums)
    sums_BK = _reduce_sequence_sums(torch.stack([local_sums[k] for k in names], dim=-1), sequence_reduce)
    sums = {name: sums_BK[:, k] for k, name in enumerate(names)}

    # ---- everything below is per sequence, from the reduced (exact) sums ------------------------
    num_tokens_B = sums["num_tokens"]
    is_nonempty_B = num_tokens_B > 0
    num_tokens_safe_B = num_tokens_B.clamp(min=1.0)
    log_ratio_seq_B = sums["log_ratio_sum"] / num_tokens_safe_B
    if advantages_B is None and variant in SEQUENCE_CLIP_VARIANTS:
        advantages_B = sums["advantage_sum"] / num_tokens_safe_B

    sequences = SequenceInputs(sums, log_ratio_seq_B, advantages_B, num_tokens_safe_B)
    objective_B, cut_counts = term.objective(sequences, eps_low, eps_high)

    mismatch_weight_B, is_over_cap_B = _mismatch_weights(
        sums, num_tokens_safe_B, mismatch_cap if rollout_log_probs is not None else None)
    policy_term_B = mismatch_weight_B * objective_B
    per_sequence_B = policy_term_B
    if ref_log_probs is not None:
        per_sequence_B = per_sequence_B - kl_coef * (sums["kl_sum"] / num_tokens_safe_B)
    if entropy is not None:
        per_sequence_B = per_sequence_B + entropy_coef * (sums["entropy_sum"] / num_tokens_safe_B)
    token_normalized = variant in TOKEN_NORMALIZED_VARIANTS
    if token_normalized:  # each sequence counts n_i times: a mean over tokens
        policy_term_B = policy_term_B * num_tokens_B
        per_sequence_B = per_sequence_B * num_tokens_B

    num_sequences = is_nonempty_B.sum().to(dtype)
    default_denominator = num_tokens_B.sum() if token_normalized else num_sequences
    denominator = (default_denominator.clamp(min=1.0) if loss_denominator is None
                   else float(loss_denominator))
    zero = torch.zeros((), dtype=dtype, device=log_probs.device)
    loss = -torch.where(is_nonempty_B, per_sequence_B, zero).sum() / denominator

    # ---- metrics (detached) -------------------------------------------------------------------
    with torch.no_grad():
        policy_loss = -torch.where(is_nonempty_B, policy_term_B, zero).sum() / denominator
        metrics = _metrics(variant, sequences, cut_counts, dtype, loss=loss.detach(), policy_loss=policy_loss,
                           num_sequences=num_sequences, mismatch_weight_B=mismatch_weight_B,
                           is_over_cap_B=is_over_cap_B)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# Inputs, reduction, statistics.
# ---------------------------------------------------------------------------------------------


def _check_shapes(log_probs: Tensor, **others: Tensor | None) -> None:
    """Every given per-token tensor has ``log_probs``'s shape (ValueError naming the argument)."""
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != log_probs.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(log_probs.shape)} "
                             f"like log_probs")


def _masked(values_BT: Tensor, is_response_token_BT: Tensor, dtype: torch.dtype) -> Tensor:
    """``values_BT`` in ``dtype`` on response tokens, 0 elsewhere (NaN/inf outside the mask dropped)."""
    return torch.where(is_response_token_BT, values_BT.to(dtype), 0.0)


def _local_sequence_sums(term_sums: dict[str, Tensor], tokens: TokenInputs, old_log_probs_BT: Tensor,
                         dtype: torch.dtype, *, advantage_sum: bool, ref_log_probs: Tensor | None,
                         entropy: Tensor | None, rollout_log_probs: Tensor | None) -> dict[str, Tensor]:
    """This rank's ``[B]`` per-sequence sums, in the column order ``sequence_reduce`` sees:
    ``num_tokens``, ``log_ratio_sum``, ``advantage_sum`` (``advantage_sum``: per-token advantages
    of a sequence-clip variant), the variant's ``term_sums``, then the optional terms' ``kl_sum``
    (k3 KL to the reference), ``entropy_sum``, ``rollout_log_ratio_sum`` and
    ``rollout_abs_diff_sum`` (old - rollout)."""
    mask_BT = tokens.is_response_token_BT
    sums = {"num_tokens": mask_BT.sum(-1).to(dtype), "log_ratio_sum": tokens.log_ratio_BT.sum(-1)}
    if advantage_sum:
        sums["advantage_sum"] = tokens.advantages_BT.sum(-1)
    sums |= term_sums
    if ref_log_probs is not None:
        ref_minus_log_probs_BT = _masked(ref_log_probs.detach(), mask_BT, dtype) - tokens.log_probs_BT
        ref_minus_log_probs_BT = ref_minus_log_probs_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        sums["kl_sum"] = (torch.exp(ref_minus_log_probs_BT) - ref_minus_log_probs_BT - 1.0).sum(-1)
    if entropy is not None:
        sums["entropy_sum"] = _masked(entropy, mask_BT, dtype).sum(-1)
    if rollout_log_probs is not None:
        rollout_log_ratio_BT = old_log_probs_BT - _masked(rollout_log_probs.detach(), mask_BT, dtype)
        sums["rollout_log_ratio_sum"] = rollout_log_ratio_BT.sum(-1)
        sums["rollout_abs_diff_sum"] = rollout_log_ratio_BT.abs().sum(-1)
    return sums


def _mismatch_weights(sums: dict[str, Tensor], num_tokens_safe_B: Tensor,
                      mismatch_cap: float | None) -> tuple[Tensor, Tensor | None]:
    """The detached behaviour weights ``m_i = min(exp(mean_t(old - rollout)), C)`` and which
    sequences the cap C cut; ones and None without rollout log-probs (``mismatch_cap`` None)."""
    if mismatch_cap is None:
        return torch.ones_like(sums["num_tokens"]), None
    log_cap = math.log(mismatch_cap)
    rollout_log_ratio_seq_B = (sums["rollout_log_ratio_sum"] / num_tokens_safe_B).detach()
    return torch.exp(rollout_log_ratio_seq_B.clamp(max=log_cap)), rollout_log_ratio_seq_B > log_cap


def _metrics(variant: Variant, sequences: SequenceInputs, cut_counts, dtype: torch.dtype, *, loss: Tensor,
             policy_loss: Tensor, num_sequences: Tensor, mismatch_weight_B: Tensor,
             is_over_cap_B: Tensor | None) -> dict[str, Tensor]:
    """:func:`gspo_loss`'s metrics (its Returns), detached, in ``dtype``. The optional terms'
    metrics come with their sums (``kl_sum``, ``entropy_sum``, ``rollout_abs_diff_sum``);
    ``is_over_cap_B``: the sequences whose behaviour weight was capped, None without one."""
    sums, num_tokens_safe_B = sequences.sums, sequences.num_tokens_safe_B
    num_tokens_B = sums["num_tokens"]
    is_nonempty_B = num_tokens_B > 0
    num_nonempty = num_sequences.clamp(min=1.0)
    num_tokens = num_tokens_B.sum()
    metrics = {"loss": loss, "policy_loss": policy_loss, "num_sequences": num_sequences, "num_tokens": num_tokens}
    metrics |= _masked_stats("response_length", num_tokens_B, is_nonempty_B)
    metrics |= _masked_stats("log_ratio_seq", sequences.log_ratio_seq_B, is_nonempty_B, with_std=True)
    metrics |= _cut_metrics(SPECS[variant].cut_stats, cut_counts, sums, is_nonempty_B, num_nonempty, num_tokens)
    if "kl_sum" in sums:
        metrics["kl_mean"] = _masked_mean(sums["kl_sum"] / num_tokens_safe_B, is_nonempty_B)
    if "entropy_sum" in sums:
        metrics["entropy_mean"] = _masked_mean(sums["entropy_sum"] / num_tokens_safe_B, is_nonempty_B)
    if is_over_cap_B is not None:
        metrics["mismatch_weight_mean"] = _masked_mean(mismatch_weight_B, is_nonempty_B)
        metrics["mismatch_weight_max"] = _masked_stats("mismatch_weight", mismatch_weight_B,
                                                       is_nonempty_B)["mismatch_weight_max"]
        metrics["mismatch_weight_ess"] = _effective_sample_size(mismatch_weight_B, is_nonempty_B)
        metrics["mismatch_capped_frac"] = (is_over_cap_B & is_nonempty_B).sum() / num_nonempty
        metrics["mismatch_log_prob_abs_diff_mean"] = sums["rollout_abs_diff_sum"].sum() / num_tokens.clamp(min=1.0)
    return {name: value.detach().to(dtype) for name, value in metrics.items()}


def _compute_dtype(log_probs: Tensor) -> torch.dtype:
    if not log_probs.is_floating_point():
        raise ValueError(f"log_probs must be a floating-point tensor, got {log_probs.dtype}")
    return torch.promote_types(log_probs.dtype, torch.float32)


def _response_mask(response_mask: Tensor, shape: torch.Size) -> Tensor:
    if response_mask.shape != shape or len(shape) != 2:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}; log_probs has {tuple(shape)}; "
                         f"both must be [num_sequences, max_len]")
    return response_mask if response_mask.dtype == torch.bool else response_mask != 0


def _split_advantages(
    advantages: Tensor, is_response_token_BT: Tensor, variant: str, dtype: torch.dtype
) -> tuple[Tensor | None, Tensor]:
    """``(advantages_B or None, advantages_BT)``; the per-token form is 0 outside the mask."""
    num_sequences, max_len = is_response_token_BT.shape
    advantages = advantages.detach().to(dtype)
    if advantages.shape == (num_sequences,):
        advantages_BT = torch.where(is_response_token_BT, advantages[:, None], 0.0)
        return advantages, advantages_BT
    if advantages.shape != (num_sequences, max_len):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}; expected [{num_sequences}] (per sequence) "
                         f"or [{num_sequences}, {max_len}] (per token)")
    advantages_BT = torch.where(is_response_token_BT, advantages, 0.0)
    if variant in SEQUENCE_CLIP_VARIANTS:
        row_max_B = torch.where(is_response_token_BT, advantages, -math.inf).amax(-1)
        row_min_B = torch.where(is_response_token_BT, advantages, math.inf).amin(-1)
        is_varying_B = is_response_token_BT.any(-1) & (row_max_B != row_min_B)
        if bool(is_varying_B.any()):
            row = int(is_varying_B.nonzero()[0, 0])
            raise ValueError(
                f"variant {variant!r} clips whole sequences and needs one advantage per sequence, but "
                f"advantages[{row}] varies over its response tokens ({row_min_B[row].item()} .. "
                f"{row_max_B[row].item()}); pass "
                f"[num_sequences] advantages or use a token-clip variant {TOKEN_CLIP_VARIANTS}"
            )
    return None, advantages_BT


def _variant_params(variant: str, params: Any) -> Any:
    """``params`` checked against the variant's ``VariantSpec.params``; None -> its defaults."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    expected = SPECS[variant].params
    if params is None:
        return None if expected is None else expected()
    if expected is None or not isinstance(params, expected):
        wanted = "None (it has no parameters besides its clip range)" if expected is None else expected.__name__
        raise ValueError(f"variant {variant!r} takes params {wanted}, got {type(params).__name__}")
    return params


def _check_options(variant, eps_low, eps_high, loss_denominator, ref_log_probs, kl_coef, entropy, entropy_coef,
                   rollout_log_probs, mismatch_cap, params) -> None:
    term = TERMS[variant]
    # cispo: eps_low = 1 is no lower bound; gmpo: a log-space range, any eps_low >= 0
    low_ok = (0.0 <= eps_low < 1.0 if term.eps_low_limit is None else 0.0 <= eps_low <= term.eps_low_limit)
    if not low_ok or not (eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 (cispo: <= 1; gmpo: any, log space) and eps_high >= 0, "
                         f"got eps_low={eps_low}, eps_high={eps_high}")
    if term.check_params is not None:
        term.check_params(params)
    if loss_denominator is not None and not loss_denominator > 0:
        raise ValueError(f"loss_denominator={loss_denominator} must be > 0 (the number of sequences of the mini-batch)")
    if kl_coef != 0.0 and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_log_probs")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropy")
    if rollout_log_probs is not None and (mismatch_cap is None or not mismatch_cap > 0):
        raise ValueError(f"rollout_log_probs needs mismatch_cap > 0 (the truncation C of the weight), "
                         f"got {mismatch_cap}")


def _reduce_sequence_sums(sums_BK: Tensor, sequence_reduce: SequenceReduce | None) -> Tensor:
    if sequence_reduce is None:
        return sums_BK
    reduced_BK = sequence_reduce(sums_BK)
    if reduced_BK.shape != sums_BK.shape:
        raise ValueError(f"sequence_reduce returned shape {tuple(reduced_BK.shape)}, expected {tuple(sums_BK.shape)}")
    return reduced_BK


def _cut_metrics(cut_stats: str, cut_counts, sums: dict[str, Tensor], is_nonempty_B: Tensor,
                 num_nonempty: Tensor, num_tokens: Tensor) -> dict[str, Tensor]:
    """The clip metrics by ``VariantSpec.cut_stats``: fractions of sequences or of tokens cut, or
    (sapo, no clip) its soft gate's weights."""
    metrics = {}
    if cut_stats == "sequence":
        is_cut_low_B, is_cut_high_B = cut_counts
        metrics["clip_frac_low"] = (is_cut_low_B & is_nonempty_B).sum() / num_nonempty
        metrics["clip_frac_high"] = (is_cut_high_B & is_nonempty_B).sum() / num_nonempty
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    elif cut_stats == "none":  # sapo: the soft gate's weights instead
        metrics["sapo_gate_weight_mean"] = sums["gate_weight_sum"].sum() / num_tokens.clamp(min=1.0)
        metrics["sapo_gate_weight_low_frac"] = (sums["num_low_gate_tokens"].sum()
                                                / num_tokens.clamp(min=1.0))
    else:
        num_cut_low_B, num_cut_high_B = cut_counts
        metrics["token_clip_frac_low"] = num_cut_low_B.sum() / num_tokens.clamp(min=1.0)
        metrics["token_clip_frac_high"] = num_cut_high_B.sum() / num_tokens.clamp(min=1.0)
        metrics["token_clip_frac"] = metrics["token_clip_frac_low"] + metrics["token_clip_frac_high"]
    return metrics


def _masked_mean(values_B: Tensor, is_included_B: Tensor) -> Tensor:
    return torch.where(is_included_B, values_B, 0.0).sum() / is_included_B.sum().clamp(min=1)


def _effective_sample_size(weights_B: Tensor, is_included_B: Tensor) -> Tensor:
    """``(sum_i w_i)^2 / (n sum_i w_i^2)`` over the included rows (n of them): 1 when all weights are
    equal, 1/n when one carries everything; 0 when there are no rows (or every weight is 0). The
    weights are divided by their max first (the value is scale-free), so tiny weights do not
    underflow in the squares."""
    weights_B = torch.where(is_included_B, weights_B.detach(), 0.0)
    peak = torch.cat([weights_B, weights_B.new_zeros(1)]).amax()  # sentinel: B = 0 works
    weights_B = weights_B / torch.where(peak > 0, peak, torch.ones_like(peak))
    total, total_sq = weights_B.sum(), (weights_B * weights_B).sum()
    count = is_included_B.sum().to(weights_B.dtype)
    denominator = count * total_sq
    return torch.where(denominator > 0, total * total / denominator.clamp(min=torch.finfo(weights_B.dtype).tiny),
                       torch.zeros_like(total))


def _masked_stats(name: str, values_B: Tensor, is_included_B: Tensor, *, with_std: bool = False) -> dict[str, Tensor]:
    """``{name}_mean|min|max`` (and population ``_std``) over the included rows; 0 if there are none."""
    values_B = values_B.detach()
    zero = torch.zeros((), dtype=values_B.dtype, device=values_B.device)
    mean = _masked_mean(values_B, is_included_B)
    stats = {f"{name}_mean": mean}
    if with_std:
        variance = _masked_mean((values_B - mean) ** 2, is_included_B)
        stats[f"{name}_std"] = variance.sqrt()
    # sentinel-padded so that B = 0 works and no host sync is needed
    inf = torch.full((1,), math.inf, dtype=values_B.dtype, device=values_B.device)
    has_any = is_included_B.any()
    row_min = torch.cat([torch.where(is_included_B, values_B, math.inf), inf]).amin()
    row_max = torch.cat([torch.where(is_included_B, values_B, -math.inf), -inf]).amax()
    stats[f"{name}_min"] = torch.where(has_any, row_min, zero)
    stats[f"{name}_max"] = torch.where(has_any, row_max, zero)
    return stats
