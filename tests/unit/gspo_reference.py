"""Independent float64 reference for the GSPO loss family: a per-sequence loop in plain Python.

Written from docs/gspo_math.md alone; it shares no code with megatron_gspo.loss.gspo. Inputs are
nested lists of Python floats (``tensor.tolist()``); the value of every J_i uses the literal
``min(r * A, clip(r) * A)`` and the gradient is derived by hand:

    d/dlp_it of the branch r * A:   gspo                 s_i A_i / n_i    (s_i = exp(mean_t(lp - old)))
                                    seq_ratio_unnorm.    S_i A_i          (S_i = exp(sum_t(lp - old)))
                                    grpo (token t)       w_it A_it / n_i  (w_it = exp(lp_it - old_it))
                                    gspo_token /
                                    seq_ratio_token_clip s_i A_it / n_i   (sg[s_i] exp(lp_it - sg[lp_it]))
                                    token_ratio_seq_clip w_it A_i / n_i
    the clipped branch clip(r) * A is constant outside [1 - eps_low, 1 + eps_high]; the min takes
    the r * A branch (and its gradient) iff r * A <= clip(r) * A.

    The four later objectives, from their papers (the value convention of docs/gspo_math.md: a
    detached weight c times exp(lp - sg[lp]) has the value c and the gradient c):
      cispo (MiniMax-M1 eq. 4-5): token t contributes sg[clip(w_it)] A_it, gradient the same,
            clip = [1 - eps_low, 1 + eps_high] of the IS weight whatever the sign of A; J_i =
            (1/n_i) sum_t; token-normalised
      sapo (eq. 5-6): f(w) = 4/tau sigmoid(tau (w - 1)), tau = tau_pos if A_it > 0 else tau_neg;
            J_i = (1/n_i) sum_t f(w_it) A_it; d/dlp_it = 4 sig (1 - sig) w_it A_it / n_i
      luspo: gspo's J_i; token-normalised
      gmpo (eq. 3 in log space): x~_t = sgn(A) min(sgn(A) x_t, sgn(A) clamp(x_t, -eps_low,
            eps_high)), x_t = log w_it; J_i = A_i exp(mean_t x~_t); the gradient flows through
            the tokens where the min takes x_t: A_i exp(mean x~) / n_i
    Token-normalised: the whole per-sequence term is multiplied by n_i and D defaults to the
    number of response tokens.

    loss = -(1/D) sum_i [ m_i J_i - kl_coef KL_i + entropy_coef H_i ]
    d KL_i / d lp_it = (1 - exp(ref_it - lp_it)) / n_i          (k3 = e^x - x - 1, x = ref - lp)
    d loss / d entropy_it = -entropy_coef / (D n_i)
"""

import math


def clip(ratio: float, eps_low: float, eps_high: float) -> float:
    return min(max(ratio, 1.0 - eps_low), 1.0 + eps_high)


def ppo_term(ratio: float, advantage: float, eps_low: float, eps_high: float) -> tuple[float, bool, str]:
    """(value, does the gradient of ratio * A flow, cut side "low"/"high"/"")."""
    unclipped = ratio * advantage
    clipped = clip(ratio, eps_low, eps_high) * advantage
    value = min(unclipped, clipped)
    takes_unclipped = unclipped <= clipped  # ties only inside the range (clip = identity) or A = 0
    side = ""
    if not takes_unclipped:
        side = "low" if ratio < 1.0 - eps_low else "high"
    return value, takes_unclipped, side


def reference_loss(
    log_probs,
    old_log_probs,
    advantages,
    response_mask,
    *,
    eps_low,
    eps_high,
    variant,
    loss_denominator=None,
    ref_log_probs=None,
    kl_coef=0.0,
    entropy=None,
    entropy_coef=0.0,
    rollout_log_probs=None,
    mismatch_cap=None,
    sapo_tau_pos=1.0,
    sapo_tau_neg=1.05,
):
    """Returns ``(loss, grad_log_probs, grad_entropy, info)``.

    ``advantages`` is a list per sequence or a list of lists per token. ``info`` has one dict per
    row: ``n``, ``J``, ``log_s``, ``cut`` ("low"/"high"/"" for sequence-clip variants),
    ``token_cuts`` (list of sides for token-clip variants), ``A`` (sequence advantage if any),
    ``mismatch_weight``, ``kl``, ``entropy``.
    """
    num_rows = len(log_probs)
    grad = [[0.0] * len(row) for row in log_probs]
    grad_entropy = [[0.0] * len(row) for row in log_probs]
    info = []
    total = 0.0
    num_sequences = 0
    for i in range(num_rows):
        tokens = [t for t, is_response in enumerate(response_mask[i]) if is_response]
        n = len(tokens)
        row_info = {"n": n, "J": 0.0, "log_s": 0.0, "cut": "", "token_cuts": [], "A": None,
                    "mismatch_weight": 1.0, "kl": 0.0, "entropy": 0.0}
        info.append(row_info)
        if n == 0:
            continue
        num_sequences += 1
        per_token_adv = isinstance(advantages[i], (list, tuple))
        adv = [advantages[i][t] if per_token_adv else advantages[i] for t in tokens]
        log_ratios = [log_probs[i][t] - old_log_probs[i][t] for t in tokens]
        log_s = sum(log_ratios) / n
        s = math.exp(log_s)
        row_info["log_s"] = log_s
        d_objective = {t: 0.0 for t in tokens}

        if variant == "gmpo":
            a_seq = adv[0]
            row_info["A"] = a_seq
            sign = (a_seq > 0) - (a_seq < 0)
            clipped = []
            for x in log_ratios:
                bounded = min(max(x, -eps_low), eps_high)
                unclipped_side, clipped_side = sign * x, sign * bounded
                takes_x = unclipped_side <= clipped_side
                clipped.append((x if takes_x else bounded, takes_x))
                row_info["token_cuts"].append(
                    "" if takes_x else ("high" if x > eps_high else "low"))
            geometric = math.exp(sum(v for v, _ in clipped) / n)
            objective = a_seq * geometric
            for t, (_, takes_x) in zip(tokens, clipped):
                d_objective[t] = a_seq * geometric / n if takes_x else 0.0
        elif variant in ("gspo", "seq_ratio_unnormalized", "token_ratio_seq_clip", "luspo"):
            a_seq = adv[0]
            row_info["A"] = a_seq
            ratio = s if variant != "seq_ratio_unnormalized" else math.exp(sum(log_ratios))
            value, flows, side = ppo_term(ratio, a_seq, eps_low, eps_high)
            row_info["cut"] = side
            if variant == "token_ratio_seq_clip" and flows:
                token_ratios = [math.exp(x) for x in log_ratios]
                value = sum(w * a_seq for w in token_ratios) / n
                for t, w in zip(tokens, token_ratios):
                    d_objective[t] = w * a_seq / n
            elif flows:
                for t in tokens:
                    d_objective[t] = ratio * a_seq / (n if variant in ("gspo", "luspo") else 1.0)
            objective = value
        else:
            objective = 0.0
            for t, a_t, x in zip(tokens, adv, log_ratios):
                w = math.exp(x)
                if variant == "gspo_token":
                    value, flows, side = ppo_term(s, a_t, eps_low, eps_high)
                    slope = s * a_t
                elif variant == "grpo":
                    value, flows, side = ppo_term(w, a_t, eps_low, eps_high)
                    slope = w * a_t
                elif variant == "seq_ratio_token_clip":
                    _, flows, side = ppo_term(w, a_t, eps_low, eps_high)
                    value = s * a_t if flows else clip(w, eps_low, eps_high) * a_t
                    slope = s * a_t
                elif variant == "cispo":
                    weight_t = clip(w, eps_low, eps_high)
                    value, flows, slope = weight_t * a_t, True, weight_t * a_t
                    side = "low" if w < 1.0 - eps_low else ("high" if w > 1.0 + eps_high else "")
                elif variant == "sapo":
                    tau = sapo_tau_pos if a_t > 0 else sapo_tau_neg
                    sig = 1.0 / (1.0 + math.exp(-tau * (w - 1.0)))
                    value, flows, side = 4.0 / tau * sig * a_t, True, ""
                    slope = 4.0 * sig * (1.0 - sig) * w * a_t
                    row_info.setdefault("gate_weights", []).append(4.0 * sig * (1.0 - sig))
                else:
                    raise ValueError(variant)
                row_info["token_cuts"].append(side)
                objective += value / n
                if flows:
                    d_objective[t] = slope / n
        row_info["J"] = objective

        weight = 1.0
        if rollout_log_probs is not None:
            mean_diff = sum(old_log_probs[i][t] - rollout_log_probs[i][t] for t in tokens) / n
            weight = min(math.exp(mean_diff), mismatch_cap)
        row_info["mismatch_weight"] = weight
        contribution = weight * objective
        d_contribution = {t: weight * d_objective[t] for t in tokens}
        if ref_log_probs is not None:
            xs = {t: ref_log_probs[i][t] - log_probs[i][t] for t in tokens}
            kl = sum(math.exp(x) - x - 1.0 for x in xs.values()) / n
            row_info["kl"] = kl
            contribution -= kl_coef * kl
            for t in tokens:
                d_contribution[t] -= kl_coef * (1.0 - math.exp(xs[t])) / n
        if entropy is not None:
            h = sum(entropy[i][t] for t in tokens) / n
            row_info["entropy"] = h
            contribution += entropy_coef * h
        scale = n if variant in ("cispo", "luspo") else 1.0  # token-normalised
        row_info["scale"] = scale
        contribution *= scale
        d_contribution = {t: scale * d for t, d in d_contribution.items()}
        total += contribution
        row_info["d_contribution"] = d_contribution

    units = (sum(row["n"] for row in info) if variant in ("cispo", "luspo") else num_sequences)
    denominator = loss_denominator if loss_denominator is not None else max(units, 1)
    for i, row_info in enumerate(info):
        if row_info["n"] == 0:
            continue
        for t, d in row_info["d_contribution"].items():
            grad[i][t] = -d / denominator
            if entropy is not None:
                grad_entropy[i][t] = -entropy_coef * row_info["scale"] / (denominator * row_info["n"])
    return -total / denominator, grad, grad_entropy, info


def reference_group_advantages(rewards, group_size, *, normalize_std=True, eps=1e-6, leave_one_out=False):
    """Per-group loop: population std, baseline mean or leave-one-out mean; equal rewards -> 0."""
    advantages = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / group_size
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / group_size)
        for j, r in enumerate(group):
            if all(other == group[0] for other in group):
                advantages.append(0.0)
                continue
            baseline = (sum(group) - r) / (group_size - 1) if leave_one_out else mean
            centred = r - baseline
            advantages.append(centred / (std + eps) if normalize_std else centred)
    return advantages
