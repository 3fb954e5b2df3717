"""The loss-level scaling contract under data x context parallelism, and the sequence count it needs.

Scaling contract (loss level)
-----------------------------
GSPO maximises ``J = (1/N) sum_i J_i`` over the N sequences of the whole mini-batch (all ranks,
all micro-batches). Under data parallelism (DP) each DP rank holds a disjoint subset of the
sequences; under context parallelism (CP) the tokens of each of those sequences are split over
the CP ranks of its CP group (every CP rank of a group holds the same sequences).

1. ``N`` = number of NON-EMPTY sequences (at least one response token) of the mini-batch,
   counted once: :func:`global_num_sequences` sums each sequence's token counts over CP first
   (a sequence may have all its tokens on one CP rank), counts the non-empty ones, then
   all-reduces over the DP group. One all-reduce pair per optimizer step, before the step.
2. Rank (d, c) computes ``loss_{d,c} = -(1/N) sum_{i in DP shard d} J_i``, with every ``s_i``
   exact through ``SequenceAllReduce`` over CP (``gspo_loss(..., loss_denominator=N,
   sequence_reduce=make_sequence_reduce(cp_group))``). All CP ranks of a group hold the same
   value ``loss_{d,c} = loss_d``; summing it over the DP ranks gives the loss: ``sum_d loss_d = -J``.
3. Gradients: ``sum over ALL dp x cp ranks of d loss_{d,c} / d params = -dJ/dparams``, the
   single-process gradient, exactly. Within a CP group each rank back-propagates only into its
   own tokens (identity backward of ``SequenceAllReduce``), so the CP ranks' gradients are
   disjoint parts that add up; the DP shards' parts add up because of the common ``1/N``.

What the per-rank gradient sums to, for whoever applies Megatron's schedule factors: the SUM
(not the mean) over the data-parallel-with-CP group (size dp x cp) and over all micro-batches of
the per-rank, per-micro-batch gradients of ``loss_{d,c}`` equals the full mini-batch gradient
(each micro-batch's loss uses the same mini-batch N). Megatron then applies its own factors,
which the adapter (train_step) must cancel, not this module: ``schedules.forward_step`` divides a
3-tuple ``(loss, num_tokens, log)`` output by ``num_tokens`` and by ``num_microbatches`` unless
``config.calculate_per_token_loss``, and multiplies a 2-tuple output by the CP size and divides it
by ``num_microbatches``; DDP (``DistributedDataParallel``) scales the gradients by
``1 / (dp x cp)`` before its all-reduce over the data-parallel-with-CP group unless
``calculate_per_token_loss`` (then it sums). (Read in megatron-core 0.16.1.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["global_num_sequences"]


def _is_parallel(group: dist.ProcessGroup | None) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def global_num_sequences(
    local_counts: torch.Tensor | Sequence[torch.Tensor],
    *,
    dp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> int:
    """Number of non-empty sequences in the whole mini-batch, identical on every rank.

    Args:
        local_counts: per-sequence response-token counts of THIS rank's tokens, ``[S]``, or a
            per-sequence response mask ``[S, L]`` (bool or 0/1, summed over L), or a list of
            those (one per micro-batch). Rows must be in the same sequence order on every CP
            rank of the group (they are: the CP ranks of a group hold the same sequences).
            Packed rows: ``per_sequence_sums(is_response_token, segment_ids, S)`` gives ``[S]``.
        dp_group: data-parallel group (ranks with the same CP rank, different sequences).
        cp_group: context-parallel group (same sequences, different tokens).
        ``None`` or a group of size 1 means that kind of parallelism is absent.

    Counting rule: a sequence counts once if it has at least one response token anywhere in its
    CP group; so counts are summed over CP BEFORE testing for zero (a rank may hold none of a
    short sequence's tokens), and the non-empty counts are summed over DP.
    """
    parts = [local_counts] if isinstance(local_counts, torch.Tensor) else list(local_counts)
    if not parts:
        raise ValueError("local_counts is empty: pass at least one (possibly zero-row) tensor")
    counts_S = torch.cat([p.reshape(p.shape[0], -1).to(torch.int64).sum(dim=1) for p in parts])
    if _is_parallel(cp_group):
        dist.all_reduce(counts_S, op=dist.ReduceOp.SUM, group=cp_group)
    num_sequences = (counts_S > 0).sum().reshape(1)
    if _is_parallel(dp_group):
        dist.all_reduce(num_sequences, op=dist.ReduceOp.SUM, group=dp_group)
    return int(num_sequences.item())


def global_num_tokens(
    local_counts: torch.Tensor | Sequence[torch.Tensor],
    *,
    dp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
) -> int:
    """Number of response tokens in the whole mini-batch, identical on every rank: the loss
    units of the token-normalised variants (``variants.TOKEN_NORMALIZED_VARIANTS``). Same inputs
    as :func:`global_num_sequences`; every token is held by exactly one (CP, DP) rank, so the
    local sums are summed over both groups."""
    parts = [local_counts] if isinstance(local_counts, torch.Tensor) else list(local_counts)
    if not parts:
        raise ValueError("local_counts is empty: pass at least one (possibly zero-row) tensor")
    total = torch.stack([p.to(torch.int64).sum() for p in parts]).sum().reshape(1)
    for group in (cp_group, dp_group):
        if _is_parallel(group):
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())
