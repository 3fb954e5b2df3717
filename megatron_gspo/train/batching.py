"""Cutting a global batch into each data-parallel rank's micro-batches (pure torch).

A batch is a dict of tensors whose first dimension is the sequence (row). The global batch of a
step is the same on every rank (generated or loaded deterministically). Two micro-batch layouts:

* padded rows (``split_for_rank``): each data-parallel rank takes a contiguous share of rows and
  cuts it into equal micro-batches of ``[b, T]``; under context parallelism each row is then
  zigzag-split over the CP ranks (``split_rows_for_context_parallel``);
* packed sequences under a token budget (``packed_micro_batches``): whole sequences packed into
  one row per micro-batch, balanced over the data-parallel ranks (``plan_micro_batches``), each
  sequence zigzag-split on its own under CP (``pack_micro_batch``).

The loss sees one row per sequence either way (``loss_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_gspo.loss.context_parallel import (
    packed_to_rows,
    per_sequence_sums,
    segment_ids,
    zigzag_positions,
    zigzag_split,
)


def split_for_rank(batch: dict[str, torch.Tensor], dp_rank: int, dp_size: int,
                   num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's rows of ``batch``, cut into ``num_microbatches`` equal micro-batches."""
    rows = next(iter(batch.values())).shape[0]
    if rows % (dp_size * num_microbatches) != 0:
        raise ValueError(f"batch of {rows} rows does not split into {dp_size} data-parallel ranks "
                         f"x {num_microbatches} micro-batches")
    per_rank = rows // dp_size
    per_mb = per_rank // num_microbatches
    start = dp_rank * per_rank
    return [{k: v[start + i * per_mb:start + (i + 1) * per_mb].clone() for k, v in batch.items()}
            for i in range(num_microbatches)]


def right_pad(rows: list[list[int]], length: int, pad_id: int) -> torch.Tensor:
    """[len(rows), length] int64, each row truncated or right-padded with ``pad_id``."""
    out = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:length]
        out[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def rl_batch(prompts: list[list[int]], outputs: list[list[int]], rollout_log_probs: list[list[float]],
             advantages: torch.Tensor, seq_length: int, pad_id: int,
             output_masks: Optional[list[Optional[list[int]]]] = None) -> dict[str, torch.Tensor]:
    """Training rows for sampled responses (one row per sample).

    ``tokens = prompt + output`` (right-padded), ``labels`` the next tokens, ``response_mask`` True
    at label positions that are output tokens, ``rollout_log_probs`` the rollout engine's
    log-probs at those positions (0 elsewhere), ``lengths`` the label positions of each sample
    (``len(prompt) + len(output) - 1``, what a packed micro-batch keeps of the row). Raises
    ValueError if a sample does not fit.

    ``output_masks[i]`` (a multi-turn trajectory, ``pipeline.generation.multiturn``): one 0/1 per output
    token, 0 for tokens the model did not generate (tool outputs, template glue): they are
    context, not response, so ``response_mask`` is False there and every per-sequence quantity
    (the token count n_i, the sequence ratio s_i) covers the model's tokens only. None: every
    output token is the model's. A non-empty output needs at least one model token (a
    trajectory ends with a model turn); an empty one (a first turn aborted before it produced a
    token) is a row without response tokens, as an empty single-turn sample is.
    """
    rows, masks, rollout = [], [], []
    if output_masks is None:
        output_masks = [None] * len(outputs)
    for i, (prompt, output, lps, omask) in enumerate(zip(prompts, outputs, rollout_log_probs,
                                                         output_masks)):
        ids = list(prompt) + list(output)
        if len(ids) - 1 > seq_length:
            raise ValueError(f"sample {i}: prompt {len(prompt)} + response {len(output)} tokens "
                             f"exceed run.seq_length + 1 = {seq_length + 1}")
        if len(lps) != len(output):
            raise ValueError(f"sample {i}: {len(lps)} log-probs for {len(output)} output tokens")
        if omask is not None and (len(omask) != len(output) or not set(omask) <= {0, 1}
                                  or (output and not any(omask))):
            raise ValueError(f"sample {i}: output mask must be {len(output)} values of 0/1 with "
                             f"at least one 1, got {len(omask)} values")
        start = len(prompt) - 1  # label position of the first output token
        rows.append(ids)
        masks.append([0] * start + (list(omask) if omask is not None else [1] * len(output)))
        rollout.append([0.0] * start + [lp if m else 0.0 for lp, m in
                                        zip(lps, omask if omask is not None else [1] * len(lps))])
    tokens = right_pad(rows, seq_length + 1, pad_id)
    num = len(rows)
    rollout_t = torch.zeros(num, seq_length)
    for i, lps in enumerate(rollout):
        rollout_t[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_length).expand(num, seq_length).contiguous(),
        "response_mask": right_pad(masks, seq_length, 0).bool(),
        "rollout_log_probs": rollout_t,
        "advantages": advantages.to(torch.float32).clone(),
        "lengths": torch.tensor([max(1, len(r) - 1) for r in rows], dtype=torch.long),
    }


def select_rows(batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index].clone() for k, v in batch.items()}


def take_rows(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`select_rows`, also of a batch whose ``routed_experts`` hold only the rows listed in
    ``batch["routed_rows"]`` (sorted: ``RLTrainer.scatter_routed_experts``); the result holds
    every field for ``rows`` and no ``routed_rows``."""
    held = batch.get("routed_rows")
    out = {}
    for key, value in batch.items():
        if key == "routed_rows":
            continue
        if key == "routed_experts" and held is not None:
            pos = torch.searchsorted(held, rows).clamp(max=max(len(held) - 1, 0))
            if len(rows) and (len(held) == 0 or not torch.equal(held[pos], rows)):
                missing = sorted(set(rows.tolist()) - set(held.tolist()))
                raise ValueError(f"routed_experts: rows {missing[:8]} were not received by this "
                                 "rank (routed_rows)")
            out[key] = value[pos].clone()
        else:
            out[key] = value[rows].clone()
    return out


# ---------------------------------------------------------------------------------------------
# Packed micro-batches under a token budget (THD), balanced over data-parallel ranks
#
# A packed micro-batch concatenates whole sequences into one row ``[1, t]``; Megatron receives
# their boundaries as ``PackedSeqParams`` (``model.gpt.forward_kwargs``). Every sequence's length
# is padded to a multiple of 2 * cp under context parallelism (the zigzag split cuts it into
# 2 * cp chunks), and the last sequence further so that the pack splits evenly over cp x tp
# (sequence parallelism cuts each CP rank's tokens over the tensor-parallel ranks). Padding slots
# carry token 0, label 0 and ``response_mask`` False: they follow the real tokens of their own
# sequence, so causal attention keeps them out of every real token's context, and the loss never
# sees them. Suffixes: B rows of the padded batch, T tokens of a padded row, S sequences of a
# micro-batch, L tokens this CP rank holds.

BUDGET_FIELD = "run.max_tokens_per_micro_batch"


def sequence_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B]`` tokens of each padded row that belong to its sequence (at least 1).

    ``batch["lengths"]`` when present (``rl_batch`` writes it); otherwise up to the last True of
    ``response_mask`` (or ``loss_mask``), which drops nothing a loss can see."""
    if "lengths" in batch:
        return batch["lengths"].to(torch.long).clamp(min=1)
    mask = batch["response_mask"] if "response_mask" in batch else batch["loss_mask"]
    positions = torch.arange(1, mask.shape[1] + 1).expand_as(mask)
    return torch.where(mask.bool(), positions, 0).amax(dim=1).clamp(min=1)


def sequence_multiple(cp_size: int) -> int:
    """Every sequence's length is padded to a multiple of this (2 * cp, or 1 without CP)."""
    return 2 * cp_size if cp_size > 1 else 1


def pack_multiple(cp_size: int, tp_size: int) -> int:
    """A whole pack is padded to a multiple of this (even zigzag chunks and SP shards)."""
    return sequence_multiple(cp_size) * tp_size


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pack_tokens(lengths: Sequence[int], cp_size: int = 1, tp_size: int = 1) -> int:
    """Tokens of one pack of sequences of ``lengths``, all padding included (before the CP split)."""
    per_sequence = sum(_round_up(int(n), sequence_multiple(cp_size)) for n in lengths)
    return _round_up(max(per_sequence, 1), pack_multiple(cp_size, tp_size))


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, dp_size: int, *,
                       cp_size: int = 1, tp_size: int = 1) -> list[list[list[int]]]:
    """Which sequences go into which micro-batch of which data-parallel rank.

    Returns ``plan[dp_rank][micro_batch] = sorted sequence indices``. Every rank gets the same
    number M of micro-batches (Megatron's schedule and the gradient all-reduce need it), each
    pack holds at most ``max_tokens`` tokens PER CONTEXT-PARALLEL RANK, i.e. ``pack_tokens`` of
    its sequences is at most ``max_tokens * cp_size`` (the budget bounds what one GPU processes,
    as Megatron/slime's "max tokens per GPU"). M is the smallest count for which the greedy
    partition below fits; a sequence that alone exceeds the budget raises ValueError naming
    ``run.max_tokens_per_micro_batch``.

    Partition: longest-processing-time greedy. Sequences in decreasing length go to the lightest
    of the ``dp_size * M`` packs where they fit; then the packs, heaviest first, go to the rank
    with the fewest tokens among those still short of M packs. Both levels balance token counts
    (LPT is within 4/3 of the optimal makespan). A pack may be empty when there are fewer
    sequences than packs; :func:`pack_micro_batch` makes it a padding-only pack.
    """
    if max_tokens < 1:
        raise ValueError(f"{BUDGET_FIELD}: must be >= 1, got {max_tokens}")
    if dp_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {dp_size}")
    capacity = max_tokens * cp_size
    lengths = [int(n) for n in lengths]
    cost = [_round_up(n, sequence_multiple(cp_size)) for n in lengths]
    for i, n in enumerate(lengths):
        if pack_tokens([n], cp_size, tp_size) > capacity:
            per_rank = pack_tokens([n], cp_size, tp_size) // cp_size
            raise ValueError(
                f"{BUDGET_FIELD}: sequence {i} has {n} tokens ({per_rank} per context-parallel "
                f"rank once padded for cp={cp_size}, tp={tp_size}), more than the budget of "
                f"{max_tokens} tokens per micro-batch per rank; raise {BUDGET_FIELD} to at least "
                f"{per_rank} or shorten the sequences (run.seq_length, rollout.max_new_tokens)")
    if not lengths:
        raise ValueError("plan_micro_batches: no sequences")

    def fits(load: int, extra: int) -> bool:
        return _round_up(load + extra, pack_multiple(cp_size, tp_size)) <= capacity

    order = sorted(range(len(lengths)), key=lambda i: (-cost[i], i))
    num_per_rank = max(1, -(-sum(cost) // (dp_size * capacity)))
    while True:
        packs: list[list[int]] = [[] for _ in range(dp_size * num_per_rank)]
        loads = [0] * len(packs)
        for i in order:
            fitting = [b for b in range(len(packs)) if fits(loads[b], cost[i])]
            if not fitting:
                break
            b = min(fitting, key=lambda b: (loads[b], b))
            packs[b].append(i)
            loads[b] += cost[i]
        else:
            break
        # With at least as many packs as sequences every sequence gets a pack of its own, and
        # each fits alone (checked above), so this loop ends.
        num_per_rank += 1
    ranks: list[list[int]] = [[] for _ in range(dp_size)]
    rank_loads = [0] * dp_size
    for b in sorted(range(len(packs)), key=lambda b: (-loads[b], b)):
        r = min((r for r in range(dp_size) if len(ranks[r]) < num_per_rank),
                key=lambda r: (rank_loads[r], r))
        ranks[r].append(b)
        rank_loads[r] += loads[b]
    return [[sorted(packs[b]) for b in ranks[r]] for r in range(dp_size)]


PAD_VALUES = {"routed_experts": -1}
"""The value of padding slots of a per-token tensor, where 0 would mean something: the rollout
servers' expert indices (``routed_experts``, ``[B, T, layers, topk]``) are -1 where unknown.
Every other per-token tensor is padded with 0."""


def _is_per_token(value: torch.Tensor, rows: int, row_length: int) -> bool:
    """``[B, T]`` or ``[B, T, ...]`` (per-token values with trailing dimensions)."""
    return value.dim() >= 2 and tuple(value.shape[:2]) == (rows, row_length)


def _padding(value: torch.Tensor, key: str, shape: tuple) -> torch.Tensor:
    return value.new_full(shape, PAD_VALUES.get(key, 0))


def pack_micro_batch(batch: dict[str, torch.Tensor], indices: Sequence[int], *,
                     cp_rank: int = 0, cp_size: int = 1, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """The packed micro-batch of rows ``indices`` of a padded batch, as CP rank ``cp_rank`` holds it.

    Per-token tensors (``[B, T]``: tokens, labels, masks, log-probs, per-token advantages) become
    ``[1, L]`` (this rank's zigzag share of the pack, ``L = pack / cp``; ``[B, T, ...]`` become
    ``[1, L, ...]``, padded with ``PAD_VALUES``); per-row tensors
    (``[B]``, e.g. advantages) become ``[S]``. Added: ``position_ids`` (positions within each
    sequence, restarting at 0), ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (the
    layout, before the CP split; int32, as Megatron/TE take them) and ``cu_seqlens_local`` (this
    rank's row, ``cu_seqlens_padded // cp``). An empty ``indices`` gives one padding-only
    sequence (no response token: no loss unit).
    """
    rows, row_length = batch["tokens"].shape
    lengths = sequence_lengths(batch)
    indices = [int(i) for i in indices]
    real = [min(int(lengths[i]), row_length) for i in indices] or [sequence_multiple(cp_size)]
    padded = [_round_up(n, sequence_multiple(cp_size)) for n in real]
    padded[-1] += pack_tokens(real, cp_size, tp_size) - sum(padded)
    cu = torch.tensor([0] + real).cumsum(0)
    cu_padded = torch.tensor([0] + padded).cumsum(0)
    out: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if key in ("lengths", "position_ids"):
            continue
        if _is_per_token(value, rows, row_length):
            parts = []
            for j, i in enumerate(indices):
                seq = value[i, :real[j]]
                parts += [seq, _padding(seq, key, (padded[j] - real[j], *value.shape[2:]))]
            if not indices:
                parts = [_padding(value, key, (padded[0], *value.shape[2:]))]
            pack = torch.cat(parts)
            out[key] = zigzag_split(pack, cp_rank, cp_size, dim=0,
                                    cu_seqlens_padded=cu_padded)[None].clone()
        elif value.dim() == 1 and value.shape[0] == rows:
            out[key] = (value[indices].clone() if indices else value.new_zeros(1))
        else:
            raise ValueError(f"pack_micro_batch: {key!r} of shape {tuple(value.shape)} is neither "
                             f"per token [{rows}, {row_length}] nor per row [{rows}]")
    out["position_ids"] = zigzag_positions(cu_padded, cp_rank, cp_size)[None].clone()
    out["cu_seqlens"] = cu.to(torch.int32)
    out["cu_seqlens_padded"] = cu_padded.to(torch.int32)
    out["cu_seqlens_local"] = (cu_padded // cp_size).to(torch.int32)
    return out


def packed_micro_batches(batch: dict[str, torch.Tensor], max_tokens: int, *, dp_rank: int,
                         dp_size: int, cp_rank: int = 0, cp_size: int = 1,
                         tp_size: int = 1) -> list[dict[str, torch.Tensor]]:
    """This rank's packed micro-batches of a padded batch (:func:`plan_micro_batches`); the same
    number on every data-parallel rank."""
    plan = plan_micro_batches(sequence_lengths(batch).tolist(), max_tokens, dp_size,
                              cp_size=cp_size, tp_size=tp_size)
    return [pack_micro_batch(batch, indices, cp_rank=cp_rank, cp_size=cp_size, tp_size=tp_size)
            for indices in plan[dp_rank]]


def split_rows_for_context_parallel(micro_batch: dict[str, torch.Tensor], cp_rank: int,
                                    cp_size: int, tp_size: int = 1) -> dict[str, torch.Tensor]:
    """CP rank ``cp_rank``'s share of a padded-rows micro-batch ``[b, T]``: each row is one
    sequence, right-padded to a multiple of 2 * cp * tp and zigzag-split (``[b, T' / cp]``), with
    its positions; per-row tensors are kept whole. Without CP the rows are returned unchanged."""
    if cp_size == 1:
        return micro_batch
    rows, row_length = micro_batch["tokens"].shape
    target = _round_up(row_length, pack_multiple(cp_size, tp_size))
    out = {}
    for key, value in micro_batch.items():
        if key == "position_ids":
            continue
        if _is_per_token(value, rows, row_length):
            value = torch.cat([value, _padding(value, key, (rows, target - row_length,
                                                            *value.shape[2:]))], dim=1)
            out[key] = zigzag_split(value, cp_rank, cp_size, dim=1).clone()
        else:
            out[key] = value.clone()
    cu = torch.tensor([0, target])
    out["position_ids"] = zigzag_positions(cu, cp_rank, cp_size).expand(rows, -1).clone()
    return out


def add_logit_index(micro_batch: dict[str, torch.Tensor], mask_key: str = "response_mask"):
    """Set ``logit_index``: the flat positions (row-major over this rank's tokens) where
    ``mask_key`` is True, so that the model computes the output layer there only. In place."""
    micro_batch["logit_index"] = micro_batch[mask_key].reshape(-1).nonzero().squeeze(1)
    return micro_batch


# --------------------------------------------------------------------------------------------
# The loss's view of a micro-batch: one row per sequence


def is_packed(micro_batch: dict) -> bool:
    return "cu_seqlens_local" in micro_batch


def loss_rows(micro_batch: dict, values: torch.Tensor, *, fill_value: float | bool = 0) -> torch.Tensor:
    """Per-token ``values`` in the micro-batch's layout -> one row per sequence ``[S, M]``.

    Padded rows are rows already; a packed row ``[1, L]`` goes through ``packed_to_rows`` with
    this rank's ``cu_seqlens_local`` (differentiable), so that GSPO sees each sequence's local
    tokens as one row, in the same sequence order on every CP rank."""
    if not is_packed(micro_batch):
        return values
    return packed_to_rows(values.reshape(-1), micro_batch["cu_seqlens_local"], fill_value=fill_value)


def response_counts(micro_batch: dict) -> torch.Tensor:
    """``[S]`` response tokens of each sequence held by this rank (``loss_scaling``'s input)."""
    mask = micro_batch["response_mask"]
    if not is_packed(micro_batch):
        return mask.to(torch.int64).sum(-1)
    cu_local = micro_batch["cu_seqlens_local"]
    seg = segment_ids(cu_local, mask.numel())
    return per_sequence_sums(mask.reshape(-1).to(torch.int64), seg, len(cu_local) - 1)


def validate_routed_experts(batch: dict, num_layers: int, topk: int, num_experts: int) -> None:
    """The rollout servers' ``routed_experts`` of an RL batch: ``[rows, T, num_layers, topk]``
    integers in ``[-1, num_experts)``, no expert twice for one (token, layer); ``rows`` is the
    length of ``batch["routed_rows"]`` when the batch holds only those rows' experts."""
    where = "gspo.routing_replay: rollout: the batch's 'routed_experts'"
    if "routed_experts" not in batch:
        raise ValueError(f"{where} is missing (the rollout servers must return the routed "
                         "experts: SGLang's return_routed_experts)")
    value, tokens = batch["routed_experts"], batch["tokens"]
    rows = len(batch["routed_rows"]) if "routed_rows" in batch else tokens.shape[0]
    expected = (rows, tokens.shape[1], num_layers, topk)
    if tuple(value.shape) != expected:
        raise ValueError(f"{where} has shape {tuple(value.shape)}, expected {expected} "
                         "(rows, positions of 'tokens', model.num_layers, model.moe_router_topk)")
    if value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"{where} must be integer expert indices, got {value.dtype}")
    if value.numel() and (int(value.min()) < -1 or int(value.max()) >= num_experts):
        raise ValueError(f"{where} holds indices outside [-1, {num_experts}): "
                         f"[{int(value.min())}, {int(value.max())}]")
    ordered = value.sort(dim=-1).values
    duplicate = ((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)).any(-1)
    if bool(duplicate.any()):
        row, pos, layer = (int(i) for i in duplicate.nonzero()[0])
        raise ValueError(f"{where}: row {row}, position {pos}, layer {layer} names an expert "
                         f"twice: {value[row, pos, layer].tolist()}")
