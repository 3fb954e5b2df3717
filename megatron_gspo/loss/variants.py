"""The registry of loss variants: names, meaning, parameters, and the two properties the code acts on.

No torch here: the formulas are in :mod:`megatron_gspo.loss.gspo` (and docs/gspo_math.md), each
variant's per-token term and per-sequence objective in its family's module of
:mod:`megatron_gspo.loss.terms` (``terms.TERMS`` has one entry per name of this table). Each
variant is described by two independent properties, and each has exactly one name here:

* ``cut_unit``: what PPO's clipping cuts, the whole sequence or one token. "Token-clip variant"
  means ``cut_unit == "token"`` everywhere in this project (:data:`TOKEN_CLIP_VARIANTS`): those
  accept per-token advantages ``A_it`` and report ``token_clip_frac*``; the sequence-clip variants
  need one advantage per sequence and report ``clip_frac*``.
* ``clipped_ratio``: whether the ratio that is compared with ``[1 - eps_low, 1 + eps_high]`` is a
  sequence-level one (``s_i``, or ``S_i``: values within about 1e-3 of 1, so the paper's sequence
  range 3e-4 / 4e-4, ``gspo.eps_low|high``) or the per-token ``w_it = pi_theta / pi_old`` (whose
  spread needs a token range such as 0.2 / 0.28, ``gspo.token_eps_low|high``).
  :func:`clips_token_ratio` answers it; it picks the range in ``GSPOConfig.clip_range``.

The two differ for ``gspo_token``: its cut unit is the token (per-token advantages), but every
token's ratio has the value ``s_i``, so it clips with the sequence range. Before this registry the
word "token-clip" meant the first property in the loss and the second in the config.

A variant's parameters besides the shared ranges are dataclasses here, each the type of the config
section named after the variant (``gspo.cispo``, ``gspo.sapo``, ``gspo.gmpo``): cispo's and gmpo's
hold their own clip range (``eps_fields`` names those fields, ``GSPOConfig.clip_range`` returns
them, the loss gets them as its ``eps_low, eps_high``); sapo's hold its gate temperatures, which the
loss takes as ``gspo_loss(..., params=SapoParams(...))`` (``VariantSpec.params``). Each parameter's
allowed range is in :data:`PARAM_RANGES` (the config refuses a value outside it, naming the
field and the range).

This module is imported by :mod:`megatron_gspo.config` (which must not import torch) and by the
loss; the ``Variant`` literal below is the type of ``gspo.variant`` and is checked against the
table at import time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, Optional, get_args

SEQUENCE_RANGE = ("eps_low", "eps_high")
TOKEN_RANGE = ("token_eps_low", "token_eps_high")

Variant = Literal["gspo", "gspo_token", "grpo", "seq_ratio_token_clip", "token_ratio_seq_clip",
                  "seq_ratio_unnormalized", "cispo", "sapo", "luspo", "gmpo"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CispoParams:
    """cispo's own clip range (config section ``gspo.cispo``): the IS weight w_it is clipped to
    ``[1 - eps_low, 1 + eps_high]`` before it is detached."""

    eps_low: float = 1.0
    """The low side; in (0, 1]. 1.0: no lower bound (MiniMax-M1 sets the low side "to a large
    value" and tunes only the high side)."""
    eps_high: float = 4.0
    """The high side (4.0: weights up to 5, ScaleRL's CISPO)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SapoParams:
    """sapo's gate temperatures (config section ``gspo.sapo``; the loss's ``params`` for sapo)."""

    tau_pos: float = 1.0
    """The gate's temperature on tokens with a positive advantage (SAPO paper: 1.0)."""
    tau_neg: float = 1.05
    """The gate's temperature on the other tokens (SAPO paper: 1.05; larger: negative updates
    fade faster off-policy)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GmpoParams:
    """gmpo's own clip range, in log space (config section ``gspo.gmpo``): each token's log-ratio
    is clipped to ``[-log_eps_low, log_eps_high]`` (PPO's min per token, by the sign of A_i) before
    the geometric mean (GMPO paper: (e^-0.4, e^0.4))."""

    log_eps_low: float = 0.4
    """The low side of the log-space clip."""
    log_eps_high: float = 0.4
    """The high side of the log-space clip."""


@dataclass(frozen=True)
class ParamRange:
    """The values a variant parameter may take: ``(low, high]`` (``[low, high]`` with
    ``low_inclusive``), finite; ``why``: what goes wrong outside it (for the message)."""

    low: float
    high: float
    why: str
    low_inclusive: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low <= value if self.low_inclusive else self.low < value
        return math.isfinite(value) and above and value <= self.high

    def __str__(self) -> str:
        return f"{'[' if self.low_inclusive else '('}{self.low:g}, {self.high:g}]"


_LOG_RATIO_LIMIT = 20.0
"""``terms.common.LOG_RATIO_LIMIT`` (this module imports no torch; a test keeps them equal)."""

_SAPO_WHY = ("within 100x of the paper's 1.0 / 1.05 either way; far outside, the float32 gate "
             "(4/tau) sigmoid(tau (w - 1)) under- or overflows: a NaN loss")

PARAM_RANGES: dict[str, ParamRange] = {
    "cispo.eps_low": ParamRange(0.0, 1.0, "the IS weight's low bound 1 - eps_low must stay >= 0 "
                                "(1: no lower bound)"),
    "cispo.eps_high": ParamRange(0.0, 100.0, "a token's IS weight may reach 1 + eps_high; beyond "
                                 "101 one token outweighs a whole batch (ScaleRL: 4)"),
    "sapo.tau_pos": ParamRange(0.01, 100.0, _SAPO_WHY, low_inclusive=True),
    "sapo.tau_neg": ParamRange(0.01, 100.0, _SAPO_WHY, low_inclusive=True),
    "gmpo.log_eps_low": ParamRange(0.0, _LOG_RATIO_LIMIT, "log-ratios are clamped to +-20 before "
                                   "each exp: a wider log-space range clips nothing"),
    "gmpo.log_eps_high": ParamRange(0.0, _LOG_RATIO_LIMIT, "log-ratios are clamped to +-20 before "
                                    "each exp: a wider log-space range clips nothing"),
}
"""``section.field`` of every variant parameter (the config sections ``gspo.cispo|sapo|gmpo``)
-> its allowed range, checked by ``GSPOConfig`` whatever the variant (a field set for a variant
not in use is still read by a later run that switches to it)."""


@dataclass(frozen=True)
class VariantSpec:
    name: str
    meaning: str
    cut_unit: Literal["sequence", "token"]
    clipped_ratio: Literal["sequence", "token", "none"]
    cut_stats: Literal["sequence", "token", "none"] = ""  # type: ignore[assignment]
    """What the clip metrics count: sequences (``clip_frac*``), tokens (``token_clip_frac*``) or
    nothing (a variant without a hard clip); default: the cut unit."""
    eps_fields: Optional[tuple[str, str]] = ()  # type: ignore[assignment]
    """The ``gspo.*`` fields of the clip range ``GSPOConfig.clip_range`` returns (``section.field``
    for a range in a variant's own section); default by the clipped ratio (sequence:
    ``eps_low|high``, token: ``token_eps_low|high``, none: None)."""
    normalization: Literal["sequence", "token"] = "sequence"
    """``sequence``: J_i is a mean over the sequence's tokens and the loss a mean over sequences;
    ``token``: each sequence counts with its length n_i and the loss is a mean over all response
    tokens of the mini-batch (CISPO's token-mean, LUSPO's length scaling)."""
    params: Optional[type] = None
    """The dataclass of the parameters ``gspo_loss`` takes as ``params`` for this variant (its
    default instance when none is passed); None: the variant has none besides its clip range."""

    def __post_init__(self):
        if not self.cut_stats:
            object.__setattr__(self, "cut_stats", self.cut_unit)
        if self.eps_fields == ():
            object.__setattr__(self, "eps_fields", {"sequence": SEQUENCE_RANGE, "token": TOKEN_RANGE,
                                                    "none": None}[self.clipped_ratio])


_SPECS = (
    VariantSpec("gspo", "GSPO: PPO on the length-normalised sequence ratio s_i (the paper's loss)",
                cut_unit="sequence", clipped_ratio="sequence"),
    VariantSpec("gspo_token", "GSPO-token: per-token advantages, every token's ratio valued s_i; "
                "equals gspo in value and gradient when A_it = A_i",
                cut_unit="token", clipped_ratio="sequence"),
    VariantSpec("grpo", "GRPO: PPO on every token's own ratio w_it, averaged over the sequence",
                cut_unit="token", clipped_ratio="token"),
    VariantSpec("seq_ratio_token_clip", "ablation: tokens cut by their own w_it, uncut tokens "
                "weighted by the sequence ratio s_i", cut_unit="token", clipped_ratio="token"),
    VariantSpec("token_ratio_seq_clip", "ablation: the sequence is cut by s_i, an uncut sequence "
                "weighted by the token ratios w_it", cut_unit="sequence", clipped_ratio="sequence"),
    VariantSpec("seq_ratio_unnormalized", "ablation: PPO on S_i = exp(sum_t log-ratio), GSPO "
                "without the 1/n_i length normalisation", cut_unit="sequence",
                clipped_ratio="sequence"),
    VariantSpec("cispo", "CISPO (MiniMax-M1): every token's gradient A_it grad log pi weighted by "
                "its IS weight w_it clipped and detached; no token dropped; token-mean",
                cut_unit="token", clipped_ratio="token", normalization="token",
                eps_fields=("cispo.eps_low", "cispo.eps_high")),
    VariantSpec("sapo", "SAPO: a sigmoid soft gate (4/tau) sigma(tau (w_it - 1)) on every token "
                "instead of a hard clip, tau_pos / tau_neg by the advantage's sign",
                cut_unit="token", clipped_ratio="none", cut_stats="none", params=SapoParams),
    VariantSpec("luspo", "LUSPO: GSPO with each sequence's term scaled by its length n_i, the loss "
                "a mean over tokens (against GSPO's length bias)", cut_unit="sequence",
                clipped_ratio="sequence", normalization="token"),
    VariantSpec("gmpo", "GMPO: A_i times the geometric mean of the token ratios, each clipped in "
                "log space (PPO's min per token)", cut_unit="sequence", clipped_ratio="token",
                cut_stats="token", eps_fields=("gmpo.log_eps_low", "gmpo.log_eps_high")),
)

SPECS: dict[str, VariantSpec] = {spec.name: spec for spec in _SPECS}
_PARAM_SECTIONS = {"cispo": CispoParams, "sapo": SapoParams, "gmpo": GmpoParams}
if set(PARAM_RANGES) != {f"{section}.{f.name}" for section, cls in _PARAM_SECTIONS.items()
                         for f in fields(cls)}:  # every parameter has its range, nothing else
    raise AssertionError(f"variants.PARAM_RANGES {sorted(PARAM_RANGES)} and the params classes "
                         "differ")

VARIANTS: tuple[str, ...] = get_args(Variant)
if VARIANTS != tuple(SPECS):  # the Literal and the table are one list, in one order
    raise AssertionError(f"variants.Variant {VARIANTS} and the table {tuple(SPECS)} differ")

# The cut unit is the whole sequence: these need one advantage per sequence.
SEQUENCE_CLIP_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS if s.cut_unit == "sequence")
# The cut unit is the token: these accept per-token advantages A_it ("token-clip variants").
TOKEN_CLIP_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS if s.cut_unit == "token")
# The variants with a clip range of their own (``GSPOConfig.clip_range``): cispo's IS-weight
# range, sapo's gate (no clip), gmpo's log-space range.
OWN_RANGE_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS
                                            if s.eps_fields not in (SEQUENCE_RANGE, TOKEN_RANGE))
# The clipped ratio is the per-token w_it and the range the token one (gspo.token_eps_low|high).
TOKEN_RATIO_CLIP_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS
                                                   if s.eps_fields == TOKEN_RANGE)


# Each sequence counts with its length: the loss is a mean over response tokens.
TOKEN_NORMALIZED_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS
                                                   if s.normalization == "token")


def clips_token_ratio(variant: str) -> bool:
    """True when ``variant`` compares the per-token ratio w_it with the token clip range
    (``gspo.token_eps_low|high``; CISPO and GMPO have ranges of their own)."""
    return variant in TOKEN_RATIO_CLIP_VARIANTS
