"""Context parallelism for the loss: zigzag token layout, packed sequences, per-sequence all-reduce.

With context parallelism (CP) the tokens of one sequence are spread over the ``cp`` ranks of a
context-parallel group. GSPO's sequence ratio ``log s_i = sum_t (lp_it - old_lp_it) / |y_i|``
needs sums over ALL tokens of ``y_i``; instead of all-gathering per-token log-probs (O(tokens)),
each rank sums its own tokens per sequence and one all-reduce of a ``[num_sequences, K]`` tensor
(K = 2: log-ratio sum, token count) makes the sums exact on every rank: O(num_sequences) bytes.
See ``docs/gspo_math.md``, "Splitting the loss over ranks".

Shape suffixes: B rows, T tokens of a full (padded) row, L tokens held by this CP rank,
S sequences, K per-sequence statistics.

Layouts
-------
Zigzag (load-balanced causal attention, as Megatron/Transformer Engine shard CP): a row of
length T is cut into ``2 * cp`` equal chunks; CP rank r holds chunks ``r`` and ``2*cp - 1 - r``,
concatenated in that order. T must be divisible by ``2 * cp``: pad the row first
(:func:`pad_to_multiple`) with ``is_response_token = False`` on the padding, so padding tokens
contribute nothing to any sum.

Packed rows (THD format): several sequences concatenated in one row, described by
``cu_seqlens = [0, len_0, len_0 + len_1, ...]``. Under CP each sequence is split on its own, as
Transformer Engine's THD attention does: its length is padded to a multiple of ``2 * cp``
(:func:`pad_cu_seqlens` gives ``cu_seqlens_padded``) and cut into ``2 * cp`` chunks; rank r holds
chunks r and ``2*cp - 1 - r`` of EVERY sequence, sequence after sequence. Rank r's local row is
then itself packed, with ``cu_seqlens_local = cu_seqlens_padded // cp`` (:func:`local_cu_seqlens`).
A sequence shorter than ``2 * cp`` real tokens leaves some ranks with padding only; their
partial sums are zero, which is exactly right.

Feeding ``gspo_loss``
---------------------
``gspo_loss`` takes per-sequence rows ``[S, L]`` with a mask and reduces every per-sequence
partial sum through ``sequence_reduce``:

* zigzag ``[B, T]`` rows: each row is one sequence; pass the local ``[B, T // cp]`` log-probs and
  the local ``is_response_token`` mask directly; ``sequence_reduce = make_sequence_reduce(cp_group)``.
* packed rows: turn the local packed tokens into rows with :func:`packed_to_rows` (one row per
  sequence, holding only this rank's tokens of it; padding slots masked), then as above.
  ``packed_to_rows`` is differentiable, so gradients flow back to the packed per-token log-probs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "SequenceAllReduce",
    "local_cu_seqlens",
    "make_sequence_reduce",
    "pad_cu_seqlens",
    "pad_to_multiple",
    "packed_to_rows",
    "per_sequence_sums",
    "rows_to_packed",
    "segment_ids",
    "zigzag_gather",
    "zigzag_indices",
    "zigzag_positions",
    "zigzag_split",
    "zigzag_unsplit",
]


# --------------------------------------------------------------------------------------------
# (a) zigzag layout


def pad_to_multiple(x: torch.Tensor, multiple: int, *, dim: int = -1, value: float | bool = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` to a multiple of ``multiple`` (e.g. ``2 * cp``) with ``value``.

    Pad log-probs with 0 and ``is_response_token`` with False: masked padding adds nothing.
    """
    length = x.shape[dim]
    pad = (-length) % multiple
    if pad == 0:
        return x
    pad_shape = list(x.shape)
    pad_shape[dim] = pad
    return torch.cat([x, x.new_full(pad_shape, value)], dim=dim)


def pad_cu_seqlens(cu_seqlens: torch.Tensor, multiple: int) -> torch.Tensor:
    """Cumulative lengths after padding every sequence's length up to a multiple of ``multiple``.

    ``multiple = 2 * cp`` gives Transformer Engine's ``cu_seqlens_padded`` for THD + CP.
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    padded = (lengths + multiple - 1) // multiple * multiple
    return torch.cat([cu_seqlens.new_zeros(1), torch.cumsum(padded, 0).to(cu_seqlens.dtype)])


def local_cu_seqlens(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Cumulative lengths of the packed sequences in one CP rank's local row (same on every rank)."""
    _check_divisible(cu_seqlens_padded, cp_size)
    return cu_seqlens_padded // cp_size


def _check_divisible(cu_seqlens_padded: torch.Tensor, cp_size: int) -> None:
    if cp_size == 1:
        return  # no split: any length is fine
    lengths = cu_seqlens_padded[1:] - cu_seqlens_padded[:-1]
    if bool(((lengths % (2 * cp_size)) != 0).any()):
        raise ValueError(
            f"every sequence length must be a multiple of 2 * cp = {2 * cp_size} for the zigzag "
            f"split, got lengths {lengths.tolist()}; pad with pad_cu_seqlens / pad_to_multiple"
        )


def zigzag_indices(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Positions in the (padded, packed) global row of the tokens CP rank ``cp_rank`` holds.

    For every sequence i with padded length ``P_i`` and chunk size ``c_i = P_i / (2 cp)``, the rank
    holds ``[start_i + r c_i, start_i + (r+1) c_i)`` followed by
    ``[start_i + (2cp-1-r) c_i, start_i + (2cp-r) c_i)``. A plain (unpacked) row of length T is
    the case ``cu_seqlens_padded = [0, T]``. Result: ``[L]`` int64 with ``L = P_total / cp``.
    With ``cp_size == 1`` nothing is split and no padding is required.
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    _check_divisible(cu_seqlens_padded, cp_size)
    if cp_size == 1:
        return torch.arange(int(cu_seqlens_padded[-1]), device=cu_seqlens_padded.device)
    cu = cu_seqlens_padded.to(torch.long).cpu()
    starts_S = cu[:-1]
    chunk_S = (cu[1:] - cu[:-1]) // (2 * cp_size)
    local_len_S = 2 * chunk_S
    seg_L = torch.repeat_interleave(torch.arange(len(chunk_S)), local_len_S)
    offset_L = torch.arange(int(local_len_S.sum())) - torch.repeat_interleave(
        torch.cumsum(local_len_S, 0) - local_len_S, local_len_S
    )
    chunk_L = chunk_S[seg_L]
    is_second_half_L = offset_L >= chunk_L
    first_L = starts_S[seg_L] + cp_rank * chunk_L + offset_L
    second_L = starts_S[seg_L] + (2 * cp_size - 1 - cp_rank) * chunk_L + (offset_L - chunk_L)
    return torch.where(is_second_half_L, second_L, first_L).to(cu_seqlens_padded.device)


def zigzag_positions(cu_seqlens_padded: torch.Tensor, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Position of each local token inside its own sequence (0-based; for position ids / RoPE)."""
    global_L = zigzag_indices(cu_seqlens_padded, cp_rank, cp_size)
    seg_L = segment_ids(local_cu_seqlens(cu_seqlens_padded, cp_size), global_L.numel())
    return global_L - cu_seqlens_padded.to(torch.long)[seg_L]


def zigzag_split(x: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int = 1,
                 cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
    """This CP rank's share of ``x`` along ``dim`` (``[B, T] -> [B, T / cp]`` for dim=1).

    Without ``cu_seqlens_padded`` the whole ``dim`` is one sequence (T divisible by 2 * cp);
    with it, ``dim`` is a packed row and every sequence is split on its own.
    """
    if cu_seqlens_padded is None:
        cu_seqlens_padded = torch.tensor([0, x.shape[dim]], device=x.device)
    elif int(cu_seqlens_padded[-1]) != x.shape[dim]:
        raise ValueError(f"cu_seqlens_padded[-1] = {int(cu_seqlens_padded[-1])} != size {x.shape[dim]}")
    return x.index_select(dim, zigzag_indices(cu_seqlens_padded, cp_rank, cp_size).to(x.device))


def zigzag_unsplit(locals_per_rank: Sequence[torch.Tensor], *, dim: int = 1,
                   cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`zigzag_split` given every rank's share (tests and references only)."""
    cp_size = len(locals_per_rank)
    first = locals_per_rank[0]
    total = first.shape[dim] * cp_size
    if cu_seqlens_padded is None:
        cu_seqlens_padded = torch.tensor([0, total])
    shape = list(first.shape)
    shape[dim] = total
    out = first.new_empty(shape)
    for rank, local in enumerate(locals_per_rank):
        out.index_copy_(dim, zigzag_indices(cu_seqlens_padded, rank, cp_size).to(out.device), local)
    return out


def zigzag_gather(x_local: torch.Tensor, cp_group: dist.ProcessGroup, *, dim: int = 1,
                  cu_seqlens_padded: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather the CP shares and undo the zigzag (tests and references only: O(tokens) bytes).

    Not differentiable; the loss never needs it (see :class:`SequenceAllReduce`).
    """
    gathered = [torch.empty_like(x_local) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(gathered, x_local.contiguous(), group=cp_group)
    return zigzag_unsplit(gathered, dim=dim, cu_seqlens_padded=cu_seqlens_padded)


# --------------------------------------------------------------------------------------------
# (b) packed sequences


def segment_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64 sequence id of every token of a packed row; -1 after ``cu_seqlens[-1]``.

    Use ``local_cu_seqlens(cu_seqlens_padded, cp)`` for a CP rank's local row.
    """
    cu = cu_seqlens.to(device="cpu", dtype=torch.long)
    if int(cu[-1]) > num_tokens:
        raise ValueError(f"cu_seqlens[-1] = {int(cu[-1])} exceeds num_tokens = {num_tokens}")
    lengths = cu[1:] - cu[:-1]
    ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    ids = torch.cat([ids, ids.new_full((num_tokens - len(ids),), -1)])
    return ids.to(cu_seqlens.device)


def per_sequence_sums(values_L: torch.Tensor, segment_ids_L: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Sum token values per sequence: ``[L]`` or ``[L, K]`` -> ``[S]`` or ``[S, K]`` (differentiable).

    Tokens with segment id -1 (trailing padding) are dropped. Mask non-response tokens first
    (multiply by ``is_response_token``). Under CP, follow with ``make_sequence_reduce(cp_group)``.
    """
    # Padding goes to an extra row that is dropped: no boolean indexing, so no host sync on GPU.
    row_L = torch.where(segment_ids_L >= 0, segment_ids_L, num_sequences)
    out = values_L.new_zeros((num_sequences + 1,) + tuple(values_L.shape[1:]))
    return out.index_add(0, row_L, values_L)[:num_sequences]


def _row_coordinates(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    seg_L = segment_ids(cu_seqlens, num_tokens)
    cu = cu_seqlens.to(device=seg_L.device, dtype=torch.long)
    is_kept_L = seg_L >= 0
    col_L = torch.arange(num_tokens, device=seg_L.device) - cu[seg_L.clamp(min=0)]
    max_len = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return seg_L[is_kept_L], col_L[is_kept_L], max_len


def packed_to_rows(values_L: torch.Tensor, cu_seqlens: torch.Tensor, *, fill_value: float | bool = 0) -> torch.Tensor:
    """Packed token values ``[L]`` -> per-sequence rows ``[S, max_len]`` (differentiable).

    Row i holds tokens ``[cu_seqlens[i], cu_seqlens[i+1])`` left-aligned; unused slots get
    ``fill_value``. Apply to the log-probs (fill 0) and to ``is_response_token`` (fill False): the
    mask then selects, in each sequence's row, exactly the tokens this rank holds.
    """
    num_tokens = values_L.shape[0]
    seg, col, max_len = _row_coordinates(cu_seqlens, num_tokens)
    num_sequences = len(cu_seqlens) - 1
    out = values_L.new_full((num_sequences, max_len) + tuple(values_L.shape[1:]), fill_value)
    kept = values_L[: len(seg)]  # tokens after cu_seqlens[-1] are padding of the row
    return out.index_put((seg, col), kept)


def rows_to_packed(rows_SM: torch.Tensor, cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of :func:`packed_to_rows` (trailing row padding filled with 0)."""
    seg, col, _ = _row_coordinates(cu_seqlens, num_tokens)
    out = rows_SM.new_zeros((num_tokens,) + tuple(rows_SM.shape[2:]))
    out[: len(seg)] = rows_SM[seg, col]
    return out


# --------------------------------------------------------------------------------------------
# (c) autograd-aware per-sequence all-reduce


class SequenceAllReduce(torch.autograd.Function):
    """Forward: all_reduce(SUM) over the CP group of per-sequence partial sums ``[S, K]``.
    Backward: identity.

    Why identity is the exact backward. Let rank r hold tokens theta_r of every sequence and
    compute partial sums ``P_r(theta_r)``; the forward gives every rank ``P = sum_r P_r``. Every
    rank then computes the SAME loss copy ``L(P)`` (``L`` depends on its tokens only through
    ``P``, everything after the reduce is replicated). The true gradient w.r.t. rank r's tokens is

        dL/dtheta_r = dL/dP . dP/dtheta_r = dL/dP . dP_r/dtheta_r,

    and ``dL/dP`` is already known, identically, on every rank. So rank r passes ``dL/dP``
    straight through (identity) into its own ``P_r`` and reaches exactly its own tokens' gradient.
    The parameters are shared, so the parameter gradient is ``sum_r dL/dP . dP_r/dparams``: the
    SUM over CP ranks of the per-rank parameter gradients, which is what the gradient all-reduce
    over the data-parallel-with-CP group (DDP) forms. A SUM in the backward (Megatron's
    "copy to region" rule) would count the gradient cp times.

    Requirement (what makes it exact): whatever depends differentiably on the reduced tensor must
    be replicated on all CP ranks. A rank-local quantity may use the reduced values only under
    stop-gradient (e.g. GSPO-token's ``sg[s_i] * exp(lp - sg[lp])``, a clip decision), and may be
    summed per sequence and reduced again. Otherwise the gradient arriving at the reduce would be
    rank-partial and would need a SUM instead.
    """

    @staticmethod
    def forward(ctx, partial_sums_SK: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
        total_SK = partial_sums_SK.clone()
        dist.all_reduce(total_SK, op=dist.ReduceOp.SUM, group=cp_group)
        return total_SK

    @staticmethod
    def backward(ctx, grad_total_SK: torch.Tensor):
        return grad_total_SK, None


def make_sequence_reduce(cp_group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``sequence_reduce`` callable for ``gspo_loss``: identity without CP (``None`` or size 1)."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return _identity

    def sequence_reduce(partial_sums_SK: torch.Tensor) -> torch.Tensor:
        return SequenceAllReduce.apply(partial_sums_SK, cp_group)

    return sequence_reduce


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x
