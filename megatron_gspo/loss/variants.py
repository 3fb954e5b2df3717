"""The registry of loss variants: names, meaning, and the two properties the code acts on (no torch).

The formulas are in :mod:`megatron_gspo.loss.gspo` (and docs/gspo_math.md). Each variant is
described by two independent properties, and each has exactly one name here:

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

This module is imported by :mod:`megatron_gspo.config` (which must not import torch) and by the
loss; the ``Variant`` literal below is the type of ``gspo.variant`` and is checked against the
table at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

Variant = Literal["gspo", "gspo_token", "grpo", "seq_ratio_token_clip", "token_ratio_seq_clip",
                  "seq_ratio_unnormalized"]


@dataclass(frozen=True)
class VariantSpec:
    name: str
    meaning: str
    cut_unit: Literal["sequence", "token"]
    clipped_ratio: Literal["sequence", "token"]


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
)

SPECS: dict[str, VariantSpec] = {spec.name: spec for spec in _SPECS}
VARIANTS: tuple[str, ...] = get_args(Variant)
if VARIANTS != tuple(SPECS):  # the Literal and the table are one list, in one order
    raise AssertionError(f"variants.Variant {VARIANTS} and the table {tuple(SPECS)} differ")

# The cut unit is the whole sequence: these need one advantage per sequence.
SEQUENCE_CLIP_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS if s.cut_unit == "sequence")
# The cut unit is the token: these accept per-token advantages A_it ("token-clip variants").
TOKEN_CLIP_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS if s.cut_unit == "token")
# The clipped ratio is the per-token w_it: these use the token clip range.
TOKEN_RATIO_CLIP_VARIANTS: tuple[str, ...] = tuple(s.name for s in _SPECS
                                                   if s.clipped_ratio == "token")


def clips_token_ratio(variant: str) -> bool:
    """True when ``variant`` compares the per-token ratio w_it with the clip range (token range)."""
    return SPECS[variant].clipped_ratio == "token"
