"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

With tensor parallelism the output layer is split along the vocabulary: tensor-parallel rank r
holds the logits of the contiguous vocabulary slice ``[vocab_start, vocab_start + V)`` with
``vocab_start = r * V`` for an even split. This module computes, for every token t,

    log_prob_t = log softmax(z_t)[y_t]                  z_t = logits_t / temperature
    entropy_t  = -sum_j p_tj log p_tj                    p_t = softmax(z_t)

without ever gathering the vocabulary, and without keeping a full-size float32 copy of the
logits: tokens are processed ``chunk_size`` at a time, and the backward pass recomputes the
softmax of each chunk from the saved input logits instead of storing it.

Shape suffixes: T tokens (all leading dims flattened), C tokens of one chunk, V the local
(this rank's) vocabulary slice.

Forward, per chunk, with ``m``, ``Z`` the global max and softmax normaliser:

    m_t        = max_j z_tj                  local max, then all_reduce(MAX) over tp
    Z_t        = sum_j exp(z_tj - m_t)       local sum, then all_reduce(SUM)
    zy_t       = z_t[y_t] - m_t              on the rank owning y_t, 0 elsewhere; all_reduce(SUM)
    S_t        = sum_j exp(z_tj - m_t) (z_tj - m_t)   (entropy only) all_reduce(SUM)
    log_prob_t = zy_t - log Z_t
    entropy_t  = log Z_t - S_t / Z_t         (= logsumexp(z_t) - sum_j p_tj z_tj)

The three sums travel in ONE all_reduce, so a chunk costs two collectives (MAX, SUM) of
O(C) floats each. Saved for backward: the input logits (a reference, not a copy), the target,
``lse_t = m_t + log Z_t`` and ``entropy_t`` (O(T) floats).

Backward. With log p_tj = z_tj - lse_t and d lse_t / d z_tj = p_tj:

    d log_prob_t / d z_tj = 1[j = y_t] - p_tj

    d entropy_t / d z_tj  = d/dz_tj [ lse_t - sum_k p_tk z_tk ]
                          = p_tj - sum_k (d p_tk / d z_tj) z_tk - p_tj
                          = -sum_k p_tk (1[k = j] - p_tj) z_tk
                          = -p_tj (z_tj - sum_k p_tk z_tk)
                          = -p_tj (log p_tj + entropy_t)       (z_tj - sum_k p_tk z_tk
                                                                 = log p_tj + lse_t - (lse_t - H_t))

and d z / d logits = 1 / temperature. With upstream gradients g_lp and g_H, the gradient of a
local logit is therefore

    d loss / d logits_tj = (1/temperature) [ g_lp_t 1[j = y_t] - p_tj (g_lp_t + g_H_t (log p_tj + H_t)) ]

Every factor is either local (p_tj, log p_tj, from the rank's own logits and the saved global
``lse_t``) or a per-token scalar, so the backward needs no communication at all.

Memory: one float32 workspace of ``chunk_size x V`` (two with entropy), plus the gradient of the
logits itself (logits' dtype, unavoidable). For float32 logits the backward works directly in the
gradient buffer. Computation is in float32 for bfloat16/float16/float32 logits, in float64 for
float64 logits (used by the tests).

Usage::

    log_probs_BS, entropy_BS = vocab_parallel_log_probs(
        logits_BSV, target_BS, tp_group=pg_collection.tp, temperature=rollout_temperature,
        with_entropy=True)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

__all__ = ["vocab_parallel_log_probs"]

DEFAULT_CHUNK_SIZE = 1024
"""1024 tokens x 151936 vocabulary x 4 bytes = 622 MB per float32 workspace at tp=1, 311 MB at
tp=2. Chunks this large keep every kernel launch big (GPU) and the per-chunk collectives rare;
chunks much larger give back the memory saving (at 4096 tokens the workspace alone is 2.5 GB)."""


def _is_parallel(group: dist.ProcessGroup | None) -> bool:
    # ``None`` means "no tensor parallelism" here, NOT torch.distributed's default (world) group.
    return group is not None and dist.get_world_size(group) > 1


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _VocabParallelLogProbs(torch.autograd.Function):
    """Chunked vocabulary-parallel log-softmax at the target plus entropy; see module docstring."""

    @staticmethod
    def forward(
        ctx,
        logits_TV: torch.Tensor,
        target_T: torch.Tensor,
        tp_group: dist.ProcessGroup | None,
        vocab_start: int,
        chunk_size: int,
        inv_temperature: float,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, vocab_size_local = logits_TV.shape
        compute_dtype = _compute_dtype(logits_TV.dtype)
        device = logits_TV.device
        is_parallel = _is_parallel(tp_group)

        # Target index inside this rank's slice; tokens whose target lives on another rank get a
        # dummy index 0 and are zeroed by ``is_owned_T``.
        local_target_T = target_T.to(torch.long) - vocab_start
        is_owned_T = (local_target_T >= 0) & (local_target_T < vocab_size_local)
        local_target_T = torch.where(is_owned_T, local_target_T, 0)

        log_probs_T = torch.empty(num_tokens, dtype=compute_dtype, device=device)
        lse_T = torch.empty(num_tokens, dtype=compute_dtype, device=device)
        entropy_T = torch.empty(num_tokens if with_entropy else 0, dtype=compute_dtype, device=device)

        rows = min(chunk_size, num_tokens)
        # Workspaces reused by every chunk: no allocation (and, on CPU, no page faults) per chunk.
        shifted_CV = torch.empty(rows, vocab_size_local, dtype=compute_dtype, device=device)
        exp_CV = torch.empty_like(shifted_CV) if with_entropy else None

        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            n = end - start
            shifted = shifted_CV[:n]
            shifted.copy_(logits_TV[start:end])  # the single float32 copy of this chunk
            if inv_temperature != 1.0:
                shifted.mul_(inv_temperature)

            max_C = shifted.amax(dim=-1)
            if is_parallel:
                dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=tp_group)
            shifted.sub_(max_C.unsqueeze(-1))

            target_shifted_C = shifted.gather(1, local_target_T[start:end].unsqueeze(-1)).squeeze(-1)
            target_shifted_C = torch.where(is_owned_T[start:end], target_shifted_C, 0.0)

            if with_entropy:
                exps = exp_CV[:n]
                torch.exp(shifted, out=exps)
                sum_exp_C = exps.sum(dim=-1)
                # sum_j e_j x_j, in place in the exp workspace. Not bmm/einsum: their gemv
                # accumulates sequentially in float32 (relative error 6e-5 at V = 76k, measured),
                # where sum() is pairwise (1e-7).
                sum_exp_x_C = exps.mul_(shifted).sum(dim=-1)
                stats_C3 = torch.stack([sum_exp_C, target_shifted_C, sum_exp_x_C], dim=1)
            else:
                sum_exp_C = shifted.exp_().sum(dim=-1)
                stats_C3 = torch.stack([sum_exp_C, target_shifted_C], dim=1)
            if is_parallel:
                dist.all_reduce(stats_C3, op=dist.ReduceOp.SUM, group=tp_group)

            log_z_C = stats_C3[:, 0].log()
            log_probs_T[start:end] = stats_C3[:, 1] - log_z_C
            lse_T[start:end] = max_C + log_z_C
            if with_entropy:
                entropy_T[start:end] = log_z_C - stats_C3[:, 2] / stats_C3[:, 0]

        ctx.save_for_backward(logits_TV, local_target_T, is_owned_T, lse_T, entropy_T)
        ctx.chunk_size = chunk_size
        ctx.inv_temperature = inv_temperature
        ctx.with_entropy = with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return log_probs_T, entropy_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_log_probs_T: torch.Tensor | None, grad_entropy_T: torch.Tensor | None):
        logits_TV, local_target_T, is_owned_T, lse_T, entropy_T = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        num_tokens, vocab_size_local = logits_TV.shape
        compute_dtype = lse_T.dtype
        inv_t = ctx.inv_temperature

        # Fold d z / d logits = 1/temperature into the per-token upstream gradients.
        if grad_log_probs_T is None:
            grad_log_probs_T = torch.zeros_like(lse_T)
        g_lp_T = grad_log_probs_T.to(compute_dtype) * inv_t
        use_entropy = ctx.with_entropy and grad_entropy_T is not None
        g_h_T = grad_entropy_T.to(compute_dtype) * inv_t if use_entropy else None

        grad_logits_TV = torch.empty_like(logits_TV, memory_format=torch.contiguous_format)
        # Float32/64 logits: work directly in the gradient buffer. Otherwise in a float32
        # workspace, cast into the gradient buffer at the end of each chunk.
        works_in_place = logits_TV.dtype == compute_dtype
        rows = min(ctx.chunk_size, num_tokens)
        work_CV = (
            None
            if works_in_place
            else torch.empty(rows, vocab_size_local, dtype=compute_dtype, device=logits_TV.device)
        )
        probs_CV = (
            torch.empty(rows, vocab_size_local, dtype=compute_dtype, device=logits_TV.device)
            if use_entropy
            else None
        )

        for start in range(0, num_tokens, ctx.chunk_size):
            end = min(start + ctx.chunk_size, num_tokens)
            n = end - start
            out = grad_logits_TV[start:end]
            work = out if works_in_place else work_CV[:n]
            work.copy_(logits_TV[start:end])
            if inv_t != 1.0:
                work.mul_(inv_t)
            work.sub_(lse_T[start:end].unsqueeze(-1))  # log p
            g_lp = g_lp_T[start:end].unsqueeze(-1)
            if use_entropy:
                probs = probs_CV[:n]
                torch.exp(work, out=probs)
                # -p * (g_lp + g_H * (log p + H))
                work.add_(entropy_T[start:end].unsqueeze(-1))
                work.mul_(g_h_T[start:end].unsqueeze(-1)).add_(g_lp).mul_(probs).neg_()
            else:
                work.exp_().mul_(g_lp).neg_()  # -p * g_lp
            # + g_lp * onehot(y), only on the rank that owns y.
            owned_g_lp = torch.where(is_owned_T[start:end], g_lp_T[start:end], 0.0)
            work.scatter_add_(1, local_target_T[start:end].unsqueeze(-1), owned_g_lp.unsqueeze(-1))
            if not works_in_place:
                out.copy_(work)
        return grad_logits_TV, None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start: int | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``target`` and (optionally) entropy, from vocab-parallel logits.

    Args:
        logits: ``[..., V]`` this rank's vocabulary slice (bf16, fp16, fp32 or fp64). Finite values.
            Any leading layout works (Megatron's ``[S, B, V]`` with an ``[S, B]`` target); a
            non-contiguous tensor is copied once by the flattening, so pass it as it comes.
        target: ``[...]`` integer token ids in the GLOBAL vocabulary. Ids outside ``[0, V_global)``
            (e.g. -100 on padding) give a finite but meaningless log-prob: mask those tokens.
        tp_group: tensor-parallel group holding the other vocabulary slices; ``None`` or a group
            of size 1 means the logits hold the whole vocabulary.
        vocab_start: global id of this slice's first entry; default ``tp_rank * V`` (even split).
        chunk_size: tokens processed at once; bounds the float32 workspace to ``chunk_size x V``.
        temperature: the logits are divided by it (log-probs of the sampling distribution).
        with_entropy: also return the entropy of softmax(logits / temperature).

    Returns:
        ``(log_probs, entropy)``, both ``[...]`` in float32 (float64 for float64 logits);
        ``entropy`` is ``None`` unless ``with_entropy``. Both are differentiable w.r.t.
        ``logits``; the gradient comes back in the logits' dtype.

    Every rank of ``tp_group`` must call this with the same tokens (collectives inside).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"target shape {tuple(target.shape)} must equal logits shape without the vocabulary "
            f"dim {tuple(logits.shape[:-1])}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"logits must be a floating dtype, got {logits.dtype}")
    vocab_size_local = logits.shape[-1]
    if vocab_start is None:
        vocab_start = dist.get_rank(tp_group) * vocab_size_local if _is_parallel(tp_group) else 0
    leading_shape = target.shape
    logits_TV = logits.reshape(-1, vocab_size_local)
    target_T = target.reshape(-1)
    log_probs_T, entropy_T = _VocabParallelLogProbs.apply(
        logits_TV, target_T, tp_group, int(vocab_start), int(chunk_size), 1.0 / temperature, with_entropy
    )
    entropy = entropy_T.view(leading_shape) if with_entropy else None
    return log_probs_T.view(leading_shape), entropy
