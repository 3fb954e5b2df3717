"""The GSPO loss as a Megatron ``loss_fn``: vocab-parallel log-probs in, per-rank loss sum out.

A micro-batch (one row per sequence, prompt + response, right-padded to the schedule's length)::

    tokens          [b, s] int64   input ids
    position_ids    [b, s] int64
    labels          [b, s] int64   tokens shifted left: labels[:, t] = tokens[:, t + 1]
    response_mask   [b, s] bool    True where labels[:, t] is a response token
    old_log_probs   [b, s] float   log pi_old(labels)        (recomputed by Megatron, or rollout's)
    advantages      [b] or [b, s]  group-relative advantages
    rollout_log_probs [b, s]       the rollout engine's per-token log-probs (the behaviour
                                   policy; each token's from the weights that sampled it): the
                                   behaviour weight m_i of the decoupled objective
    ref_log_probs   [b, s]         with gspo.kl_coef > 0: log pi_ref of the frozen reference
                                   policy (computed by Megatron, forward only; RLTrainer)

``make_gspo_loss_fn`` returns ``loss_fn(logits, batch) -> (sum over this rank's sequences of the
per-sequence loss, metrics)``; ``train_step.forward_backward`` applies the scaling contract (divide
by the global number of sequences N, or of response tokens for the token-normalised variants
cispo and luspo, and undo Megatron's micro-batch and DP factors). Under context
parallelism the per-sequence sums go through ``sequence_reduce`` (an all-reduce over the CP group
with identity backward), so every CP rank has the exact ``s_i``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_gspo.config import GSPOConfig, ModelConfig
from megatron_gspo.loss import gspo
from megatron_gspo.model import gpt
from megatron_gspo.train.batching import loss_rows


def count_sequences(response_mask: torch.Tensor) -> int:
    """Loss units of a micro-batch: rows with at least one response token."""
    return int(response_mask.any(dim=-1).sum())


def make_gspo_loss_fn(model: ModelConfig, gspo_cfg: GSPOConfig, pg_collection, *,
                      temperature: float = 1.0,
                      sequence_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
    """Build the Megatron loss function for the configured GSPO variant.

    Any micro-batch layout of ``train.batching`` works: padded rows, zigzag rows, or a packed row
    (turned into one row per sequence by ``batching.loss_rows``), with the logits of every
    position or of ``logit_index`` only (``model.gpt.micro_batch_log_probs``).
    """
    eps_low, eps_high = gspo_cfg.clip_range()
    variant_params = gspo_cfg.variant_params()
    need_entropy = gspo_cfg.entropy_coef > 0

    def loss_fn(logits: torch.Tensor, batch: dict):
        log_probs, entropy = gpt.micro_batch_log_probs(logits, batch, model, pg_collection,
                                                       temperature=temperature,
                                                       with_entropy=need_entropy)

        def rows(values, fill_value=0):
            return None if values is None else loss_rows(batch, values, fill_value=fill_value)

        advantages = batch["advantages"]
        if advantages.dim() == 2:  # per token
            advantages = rows(advantages)
        use_rollout = gspo_cfg.uses_behaviour_weight()  # decoupled: m_i; bypass: none
        loss_sum, metrics = gspo.gspo_loss(
            rows(log_probs),
            rows(batch["old_log_probs"]),
            advantages,
            rows(batch["response_mask"], fill_value=False),
            eps_low=eps_low,
            eps_high=eps_high,
            variant=gspo_cfg.variant,
            loss_denominator=1.0,  # a SUM over sequences; train_step divides by the global N
            # (the global response-token count for the token-normalised variants)
            sequence_reduce=sequence_reduce,
            ref_log_probs=rows(batch.get("ref_log_probs")) if gspo_cfg.kl_coef > 0 else None,
            kl_coef=gspo_cfg.kl_coef,
            entropy=rows(entropy),
            entropy_coef=gspo_cfg.entropy_coef,
            rollout_log_probs=rows(batch.get("rollout_log_probs")) if use_rollout else None,
            mismatch_cap=gspo_cfg.mismatch_cap if use_rollout else None,
            params=variant_params,
        )
        return loss_sum, metrics

    return loss_fn


def make_log_prob_fn(model: ModelConfig, pg_collection, *, key: str = "old_log_probs",
                     temperature: float = 1.0):
    """A forward-only ``loss_fn`` that stores this policy's per-token log-probs in ``batch[key]``.

    Used to recompute log pi_old with Megatron before the updates of a rollout batch, and with
    ``key="ref_log_probs"`` for the frozen reference policy's log pi_ref (on the last pipeline
    stage, where the logits are). The values are stored in the micro-batch's own layout.
    """

    def loss_fn(logits: torch.Tensor, batch: dict):
        with torch.no_grad():
            log_probs, _ = gpt.micro_batch_log_probs(logits, batch, model, pg_collection,
                                                     temperature=temperature)
        batch[key] = log_probs.detach()
        return log_probs.new_zeros(()), {}

    return loss_fn
