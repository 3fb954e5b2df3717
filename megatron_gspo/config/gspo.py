"""The section ``gspo`` (:class:`GSPOConfig`): the loss variant, its clip ranges and the RL
step (docs/gspo_math.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from megatron_gspo.config.checks import require
from megatron_gspo.loss.variants import (PARAM_RANGES, SEQUENCE_RANGE, SPECS, CispoParams,
                                         GmpoParams, SapoParams, Variant)

COEF_LIMIT = 100.0
"""The largest |gspo.kl_coef| and |gspo.entropy_coef|."""


@dataclass(kw_only=True, slots=True)
class GSPOConfig:
    """The loss and the RL step (docs/gspo_math.md)."""

    # the flat keys of the variants' parameters before they got sections of their own
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "cispo_eps_low": "cispo.eps_low", "cispo_eps_high": "cispo.eps_high",
        "sapo_tau_pos": "sapo.tau_pos", "sapo_tau_neg": "sapo.tau_neg",
        "gmpo_log_eps_low": "gmpo.log_eps_low", "gmpo_log_eps_high": "gmpo.log_eps_high"}

    variant: Variant = "gspo"
    """One of ``megatron_gspo.loss.variants.VARIANTS`` (names and meaning in that registry)."""
    eps_low: float = 3e-4
    """Sequence clip range, low side (paper: 3e-4)."""
    eps_high: float = 4e-4
    """Sequence clip range, high side (paper: 4e-4)."""
    token_eps_low: float = 0.2
    """Token clip range, low side, for the variants that clip the per-token ratio w_it (grpo,
    seq_ratio_token_clip: ``variants.TOKEN_RATIO_CLIP_VARIANTS``); the others use eps_low."""
    token_eps_high: float = 0.28
    """Token clip range, high side (see token_eps_low)."""
    cispo: CispoParams = field(default_factory=CispoParams)
    """cispo's own clip range of the IS weight: ``gspo.cispo.eps_low`` (in (0, 1]; 1.0, the
    default: no lower bound) and ``gspo.cispo.eps_high`` (4.0; in (0, 100])
    (``variants.CispoParams``). Every variant parameter's range: ``variants.PARAM_RANGES``."""
    sapo: SapoParams = field(default_factory=SapoParams)
    """sapo's gate temperatures: ``gspo.sapo.tau_pos`` (1.0) and ``gspo.sapo.tau_neg`` (1.05),
    each in [0.01, 100] (``variants.SapoParams``)."""
    gmpo: GmpoParams = field(default_factory=GmpoParams)
    """gmpo's own clip range in log space: ``gspo.gmpo.log_eps_low`` and ``gspo.gmpo.log_eps_high``
    (0.4 / 0.4), each in (0, 20] (``variants.GmpoParams``)."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    normalize_std: bool = True
    """Divide advantages by the group's population std (False = Dr.GRPO)."""
    leave_one_out: bool = False
    """Baseline each response by the mean of the other G-1 rewards."""
    kl_coef: float = 0.0
    """In [0, 100]. Weight of the k3 KL to a frozen reference policy, per sequence the token-mean of
    exp(ref - lp) - (ref - lp) - 1. With kl_coef > 0 the RL trainer keeps a second, frozen copy of
    the initial policy (run.init_from, or the run.seed initialisation) in the same parallel layout
    (its weights' memory once more) and computes its log-probs with Megatron for every rollout
    batch. 0: no reference model."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (per sequence the token-mean entropy of the policy), in
    [-100, 100]."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where log pi_old of the ratio s_i comes from: the objective under staleness
    (docs/gspo_math.md, "The objective under staleness"). ``recompute``: the DECOUPLED form;
    pi_old is the proximal policy, the trainer's weights at the start of the step, recomputed by
    Megatron (a forward pass per rollout batch), and the behaviour weight m_i (mismatch_correction)
    corrects for the policy the tokens were sampled with (the rollout engine's numerics and, with
    asynchronous rollout, older weight versions). ``rollout``: the BYPASS form; the rollout
    engine's recorded per-token log-probs are pi_old (the ratio is taken against the behaviour
    policy, no separate weight)."""
    mismatch_correction: Optional[bool] = None
    """Multiply each sequence's objective by the behaviour weight
    m_i = min(exp(mean_t(log pi_old - log pi_rollout)), mismatch_cap), detached, from the rollout's
    per-token log-probs (each token's from the weights that sampled it). None (default): on with
    old_logprobs: recompute (the decoupled objective), off with rollout (there pi_old IS the
    rollout's log-probs and the weight would be 1). true needs old_logprobs: recompute; false with
    recompute clips against the proximal policy and ignores the behaviour policy."""
    mismatch_cap: float = 2.0
    """C, the truncation of the behaviour weight m_i (>= 1; an upper cap only, as truncated IS).
    m_i is a geometric mean over tokens like s_i, so its spread does not grow with the length: at
    2.0 a sequence is truncated only when its mean per-token log-ratio exceeds ln 2 = 0.69, far
    beyond what the engine's numerics or a few versions of staleness give at normal learning
    rates, and no sequence weighs more than twice an on-policy one (also the default cap of verl's
    and slime's truncated importance sampling, which they apply per token)."""
    updates_per_rollout: int = 1
    """k: optimizer steps (mini-batches) per rollout batch."""
    dynamic_sampling: bool = False
    """Drop zero-std groups and sample more prompts to fill the batch."""
    routing_replay: Literal["none", "old", "rollout"] = "none"
    """Routing replay of the MoE routers (docs/routing.md; Megatron-Core's RouterReplay):
    ``none``: every forward routes by its own router; ``old`` (R2): the training forwards of a
    step use the top-k experts recorded in the old-log-prob forward of the same tokens;
    ``rollout`` (R3): the old-log-prob forward and the training forwards use the experts the
    rollout servers routed each token to (the batch's ``routed_experts``; SGLang's
    ``return_routed_experts``). Not with activation recompute that re-runs the router
    (model.recompute_granularity full, or selective with ``moe``)."""
    routing_metrics: bool = True
    """After the last update of each rollout batch, one forward-only pass over the batch for
    ``routing_change_frac*`` (top-k expert sets of the old vs the updated policy) and
    ``token_log_ratio_var`` / ``seq_log_ratio_var`` (docs/routing.md); false skips that pass (one
    forward per step less) and those metrics."""

    def __post_init__(self) -> None:
        for name in ("eps_low", "eps_high", "token_eps_low", "token_eps_high"):
            value = getattr(self, name)
            require(0 < value < 1, f"gspo.{name}: must be in (0, 1), got {value}")
        for dotted, allowed in PARAM_RANGES.items():  # every variant's, whichever is in use
            section, name = dotted.split(".")
            value = getattr(getattr(self, section), name)
            require(value in allowed,
                    f"gspo.{dotted}: must be in {allowed}, got {value} ({allowed.why})")
        require(self.group_size >= 2,
                f"gspo.group_size: must be >= 2 for group-relative advantages, got {self.group_size}")
        for name, low in (("kl_coef", 0.0), ("entropy_coef", -COEF_LIMIT)):
            value = getattr(self, name)
            require(math.isfinite(value) and low <= value <= COEF_LIMIT,
                    f"gspo.{name}: must be in [{low:g}, {COEF_LIMIT:g}], got {value} (a weight "
                    "beyond that swamps the policy term, whose scale is that of the advantages, "
                    "and overflows float32 near 3.4e38: a NaN loss)")
        require(self.mismatch_cap >= 1, f"gspo.mismatch_cap: must be >= 1, got {self.mismatch_cap}")
        require(not (self.mismatch_correction and self.old_logprobs == "rollout"),
                "gspo.mismatch_correction: true needs gspo.old_logprobs: recompute (with the "
                "rollout's log-probs as pi_old, the bypass form, the weight is always 1); leave it "
                "unset or set it to false")
        require(self.updates_per_rollout >= 1,
                f"gspo.updates_per_rollout: must be >= 1, got {self.updates_per_rollout}")

    def uses_behaviour_weight(self) -> bool:
        """Whether the loss multiplies J_i by the behaviour weight m_i (mismatch_correction, None
        resolved by old_logprobs: on for recompute, off for rollout)."""
        if self.mismatch_correction is None:
            return self.old_logprobs == "recompute"
        return self.mismatch_correction

    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) for the configured variant: the token range for the variants that
        clip the per-token ratio w_it, the sequence range for the others (gspo_token included:
        its tokens' ratios have the value s_i); cispo's and gmpo's own, from their sections
        (gmpo: log space); sapo has no clip (the sequence range is returned and unused)."""
        values = []
        for dotted in SPECS[self.variant].eps_fields or SEQUENCE_RANGE:  # e.g. "cispo.eps_low"
            value = self
            for name in dotted.split("."):
                value = getattr(value, name)
            values.append(value)
        return values[0], values[1]

    def variant_params(self) -> Any:
        """``gspo_loss``'s ``params`` for the configured variant: the section named after it when
        the registry gives the variant a params class (``VariantSpec.params``: sapo's), else None."""
        return None if SPECS[self.variant].params is None else getattr(self, self.variant)
