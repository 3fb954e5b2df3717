"""Each loss variant's math, one module per family; ``TERMS`` maps every name of the registry
(:mod:`megatron_gspo.loss.variants`) to its :class:`VariantTerm`.

    sequence_ratio  gspo, luspo, seq_ratio_unnormalized, token_ratio_seq_clip, gspo_token
    token_ratio     grpo, seq_ratio_token_clip
    cispo, sapo, gmpo

A new variant: its row in ``variants._SPECS`` (and its params dataclass there, if it has any), its
two functions in a module here, its entry below; ``gspo_loss`` needs no change.
"""

from __future__ import annotations

from megatron_gspo.loss.terms import cispo, gmpo, sapo, sequence_ratio, token_ratio
from megatron_gspo.loss.terms.common import VariantTerm, no_token_sums
from megatron_gspo.loss.variants import VARIANTS

TERMS: dict[str, VariantTerm] = {
    "gspo": VariantTerm(no_token_sums, sequence_ratio.ppo_on_seq_ratio),
    "gspo_token": VariantTerm(sequence_ratio.gspo_token_sums, sequence_ratio.gspo_token),
    "grpo": VariantTerm(token_ratio.grpo_sums, token_ratio.token_mean),
    "seq_ratio_token_clip": VariantTerm(token_ratio.seq_ratio_token_clip_sums, token_ratio.seq_ratio_token_clip),
    "token_ratio_seq_clip": VariantTerm(sequence_ratio.token_ratio_sums, sequence_ratio.token_ratio_seq_clip),
    "seq_ratio_unnormalized": VariantTerm(no_token_sums, sequence_ratio.ppo_on_unnormalized_ratio),
    "cispo": VariantTerm(cispo.token_sums, token_ratio.token_mean, eps_low_limit=cispo.EPS_LOW_LIMIT),
    "sapo": VariantTerm(sapo.token_sums, sapo.objective, check_params=sapo.check_params),
    "luspo": VariantTerm(no_token_sums, sequence_ratio.ppo_on_seq_ratio),
    "gmpo": VariantTerm(gmpo.token_sums, gmpo.objective, eps_low_limit=gmpo.EPS_LOW_LIMIT),
}
if tuple(TERMS) != VARIANTS:  # one entry per registry name, in its order
    raise AssertionError(f"terms.TERMS {tuple(TERMS)} and variants.VARIANTS {VARIANTS} differ")
