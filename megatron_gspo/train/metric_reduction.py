"""How per-micro-batch metrics of the RL step combine into one value per rollout batch.

Each micro-batch's loss function returns its metrics over its own rows: means over its sequences,
fractions of its tokens, extremes, and the counts they are taken over (``num_sequences``,
``num_tokens``). The value of a whole rollout batch (k mini-batches, each split over micro-batches
and data-parallel ranks) is NOT the plain mean of the micro-batch values: a token fraction of a
micro-batch with 40 tokens must count four times as much as one with 10. ``REDUCTIONS`` says for
every metric name how it combines, as ``megatron_gspo.loss.gspo.gspo_loss`` documents its metrics:

    sum      counts: summed
    mean     a mean over the unit counted by ``weight`` (sequences or tokens): weighted by it
    sum_per  a sum over the micro-batch's sequences (the loss, with loss_denominator = 1): summed,
             then divided by the total of ``weight``, i.e. the mean per sequence
    std      a population std over sequences: the pooled population std of all sequences, from
             each micro-batch's std, its mean (the metric named by ``mean``) and its count
    var      a population variance, pooled the same way (exactly the variance of all the values:
             sum_j w_j (v_j + (m_j - M)^2) / W is the sum of squares over the sum of counts)
    ess      a normalised effective sample size (sum_i x_i)^2 / (n sum_i x_i^2) over sequences:
             from each micro-batch's ess e_j, the mean m_j of the same values (``mean``) and its
             count n_j, the mean square is q_j = m_j^2 / e_j (0 when e_j = 0: then every x_i = 0),
             and the pooled value is M^2 / Q with M, Q the count-weighted means of m_j, q_j
    min/max  over the micro-batches that hold any sequence (an empty one reports a 0 sentinel)

A metric name missing from the table (and from ``PATTERN_REDUCTIONS``, names with a layer
index) is an error: a new metric states how it combines.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Optional

import torch.distributed as dist


@dataclass(frozen=True)
class Reduction:
    how: Literal["sum", "mean", "sum_per", "std", "var", "ess", "min", "max"]
    weight: Optional[str] = None
    """The count the metric is taken over: ``num_sequences`` or ``num_tokens``."""
    mean: Optional[str] = None
    """For ``std`` / ``var`` / ``ess``: the metric holding the mean of the same values."""


_COUNT = Reduction("sum")
_PER_SEQUENCE = Reduction("mean", "num_sequences")
_PER_TOKEN = Reduction("mean", "num_tokens")
_MIN = Reduction("min", "num_sequences")
_MAX = Reduction("max", "num_sequences")

REDUCTIONS: dict[str, Reduction] = {
    # counts
    "num_sequences": _COUNT,
    "num_tokens": _COUNT,
    # -(1/D) sum_i (...) with D = 1 (make_gspo_loss_fn): a sum over the micro-batch's sequences
    "loss": Reduction("sum_per", "num_sequences"),
    "policy_loss": Reduction("sum_per", "num_sequences"),
    # per-sequence statistics
    "response_length_mean": _PER_SEQUENCE,
    "response_length_min": _MIN,
    "response_length_max": _MAX,
    "log_ratio_seq_mean": _PER_SEQUENCE,
    "log_ratio_seq_std": Reduction("std", "num_sequences", mean="log_ratio_seq_mean"),
    "log_ratio_seq_min": _MIN,
    "log_ratio_seq_max": _MAX,
    "clip_frac_low": _PER_SEQUENCE,  # fractions of sequences
    "clip_frac_high": _PER_SEQUENCE,
    "clip_frac": _PER_SEQUENCE,
    "kl_mean": _PER_SEQUENCE,  # mean_i KL_i
    "entropy_mean": _PER_SEQUENCE,  # mean_i H_i, H_i the token-mean entropy of sequence i
    "mismatch_weight_mean": _PER_SEQUENCE,  # m_i, the behaviour weight (docs/gspo_math.md)
    "mismatch_weight_max": _MAX,
    "mismatch_weight_ess": Reduction("ess", "num_sequences", mean="mismatch_weight_mean"),
    "mismatch_capped_frac": _PER_SEQUENCE,
    # per-token statistics
    "token_clip_frac_low": _PER_TOKEN,  # fractions of response tokens
    "token_clip_frac_high": _PER_TOKEN,
    "token_clip_frac": _PER_TOKEN,
    "sapo_gate_weight_mean": _PER_TOKEN,  # sapo: the soft gate's gradient weights, per token
    "sapo_gate_weight_low_frac": _PER_TOKEN,
    "mismatch_log_prob_abs_diff_mean": _PER_TOKEN,  # token-mean |old - rollout|
    "rollout_trainer_logprob_abs_diff": _PER_TOKEN,  # token-mean |trainer - rollout|
    # after the step's updates (train.routing_metrics; docs/routing.md)
    "routing_change_frac": _PER_TOKEN,  # fraction of (response token, layer) pairs
    "routing_change_any_frac": _PER_TOKEN,  # fraction of response tokens
    "token_log_ratio_mean": _PER_TOKEN,  # log w_it = lp_new - lp_old over response tokens
    "token_log_ratio_var": Reduction("var", "num_tokens", mean="token_log_ratio_mean"),
    "seq_log_ratio_mean": _PER_SEQUENCE,  # log s_i over sequences
    "seq_log_ratio_var": Reduction("var", "num_sequences", mean="seq_log_ratio_mean"),
}

PATTERN_REDUCTIONS: tuple[tuple[re.Pattern, Reduction], ...] = (
    (re.compile(r"routing_change_frac_layer\d+"), _PER_TOKEN),  # per global layer L
)


def reduction_of(key: str) -> Optional[Reduction]:
    """The rule for metric ``key`` (``REDUCTIONS``, then ``PATTERN_REDUCTIONS``), or None."""
    if key in REDUCTIONS:
        return REDUCTIONS[key]
    for pattern, rule in PATTERN_REDUCTIONS:
        if pattern.fullmatch(key):
            return rule
    return None

NOT_REPORTED = frozenset({"loss_sum"})
"""``train_step``'s raw per-rank loss sum (the same number as ``loss`` here)."""


def combine_metrics(per_microbatch: list[dict]) -> dict[str, float]:
    """Combine metric dicts (any number of micro-batches, from any ranks) per ``REDUCTIONS``."""
    values: dict[str, list[tuple[float, dict]]] = {}
    for m in per_microbatch:
        for key, value in m.items():
            if key in NOT_REPORTED:
                continue
            if reduction_of(key) is None:
                raise KeyError(f"metric {key!r} has no entry in "
                               "megatron_gspo.train.metric_reduction.REDUCTIONS: say how it "
                               "combines over micro-batches and ranks (by sequences, by tokens, "
                               "sum, min, max)")
            values.setdefault(key, []).append((float(value), m))
    out = {}
    for key, entries in values.items():
        rule = reduction_of(key)

        def weight(m: dict) -> float:
            if rule.weight not in m:
                raise KeyError(f"metric {key!r} is weighted by {rule.weight!r}, which its "
                               f"micro-batch does not report")
            return float(m[rule.weight])

        if rule.how == "sum":
            out[key] = sum(v for v, _ in entries)
        elif rule.how in ("min", "max"):
            kept = [v for v, m in entries if weight(m) > 0]
            out[key] = (min(kept) if rule.how == "min" else max(kept)) if kept else 0.0
        else:
            total = sum(weight(m) for _, m in entries)
            if total <= 0:
                out[key] = 0.0
            elif rule.how == "sum_per":
                out[key] = sum(v for v, _ in entries) / total
            elif rule.how == "mean":
                out[key] = sum(v * weight(m) for v, m in entries) / total
            elif rule.how == "ess":  # (mean of x)^2 / (mean of x^2), over all sequences
                means = [float(m[rule.mean]) for _, m in entries]
                grand = sum(mu * weight(m) for mu, (_, m) in zip(means, entries)) / total
                mean_sq = sum(weight(m) * (mu * mu / e if e > 0 else 0.0)
                              for mu, (e, m) in zip(means, entries)) / total
                out[key] = grand * grand / mean_sq if mean_sq > 0 else 0.0
            else:  # std / var: sum_j w_j (v_j + (m_j - M)^2) / W, the variance of all rows
                means = [float(m[rule.mean]) for _, m in entries]
                grand = sum(mu * weight(m) for mu, (_, m) in zip(means, entries)) / total
                spreads = [s * s if rule.how == "std" else s for s, _ in entries]
                var = sum(weight(m) * (v + (mu - grand) ** 2)
                          for mu, v, (_, m) in zip(means, spreads, entries)) / total
                out[key] = math.sqrt(max(var, 0.0)) if rule.how == "std" else max(var, 0.0)
    return out


def is_metric_rank(pg) -> bool:
    """The ranks whose micro-batch metrics count: the last pipeline stage, one rank of each
    tensor- and context-parallel group (the others hold copies of the same values)."""
    return pg.pp.rank() == pg.pp.size() - 1 and pg.tp.rank() == 0 and pg.cp.rank() == 0


def reduce_metrics(per_microbatch: list[dict], pg) -> dict[str, float]:
    """The metrics of every micro-batch on every data-parallel rank, combined (``REDUCTIONS``).

    Collective over the world: every rank calls it with its micro-batch metric dicts (ranks that
    are not metric ranks may pass anything; what they pass is ignored) and gets the same result.
    """
    local = ([{k: float(v) for k, v in m.items()} for m in per_microbatch]
             if is_metric_rank(pg) else [])
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return combine_metrics([m for part in gathered for m in part])
