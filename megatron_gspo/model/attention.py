"""Core attention for Megatron's local spec: causal, GQA, packed sequences (THD), context parallel.

Megatron-Core's local-spec ``DotProductAttention`` refuses packed sequences and context
parallelism (both are Transformer Engine features, GPU only). :class:`PackedCoreAttention` takes
its place in the local spec's ``SelfAttention`` submodules (``core_attention``), with the same
constructor and the same ``forward(query, key, value, attention_mask, attn_mask_type,
attention_bias, packed_seq_params)``, and computes the same function:

* ``[s, b, h, d]`` input (``packed_seq_params`` None): every batch row is one causal sequence;
* ``[t, h, d]`` input (``packed_seq_params.qkv_format == "thd"``): the sequences of
  ``cu_seqlens`` packed in one row; a token attends to the earlier tokens of ITS OWN sequence
  only. With ``cu_seqlens_q_padded`` (context parallelism, or sequences padded to a multiple of
  some size) the padded boundaries define the layout, as in Megatron's THD RoPE and in TE; the
  padding slots sit after the real tokens of their sequence, so causality keeps them out of every
  real token's context.
* context parallelism (CP): each CP rank holds, of every sequence, the zigzag chunks ``r`` and
  ``2 cp - 1 - r`` (``megatron_gspo.loss.context_parallel.zigzag_indices``; for ``[s, b, h, d]``
  each row is one sequence split that way, which is what Megatron's RoPE slicing assumes). Keys
  and values are all-gathered over the CP group, put back in sequence order, and every local
  query attends to its causal prefix. The backward sends each rank's gradient of the gathered
  K/V back to their owners with a reduce-scatter (an all-reduce and a slice on gloo, which has no
  reduce-scatter), so dK/dV of a token sums the contributions of the queries of every rank.

Shape suffixes: Q local query tokens, K key tokens (all CP ranks, in sequence order), H query
heads, N key/value heads (GQA groups), G = H / N query heads per group, D head width.

Two kernels compute the same function (``kernel=``; ``"auto"`` picks by CP size):

* without CP, ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` (on CPU its flash
  kernel, blockwise in C++ with a recomputing backward; on CUDA flash / memory-efficient), once per
  sequence of the pack (once for the whole batch when every sequence has the same length, as in
  ``[s, b, h, d]`` rows), GQA native. Each sequence is causal from its own first
  token, which is exactly the packed layout's mask. 4-5x faster than the plain-torch kernel on
  CPU (docs/performance.md, "Core attention kernels").
* with CP (or ``"blockwise"``): the plain-torch blockwise kernel below, whose per-query key
  ranges express the zigzag layout's mask; SDPA's causal mask cannot.

The blockwise kernel is flash-attention's algorithm in plain torch: queries are
processed ``BLOCK_Q`` at a time against the key range their sequences need, only ``out`` and the
log-sum-exp of every row are saved, and the backward recomputes each block's probabilities. Peak
memory is ``O(BLOCK_Q x K x H)`` per layer instead of ``O(Q x K x H)``. Softmax in float32 for
half-precision inputs (Megatron's ``attention_softmax_in_fp32``), float64 for float64 inputs.

Why a key range per query is enough: in sequence order, the keys a query may see are exactly the
contiguous range ``[start of its sequence, its own global position]``, so each query carries two
integers (``lo``, ``hi``) and a block's mask is ``lo <= j <= hi``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_gspo.loss.context_parallel import segment_ids, zigzag_indices

__all__ = ["BLOCK_Q", "KERNELS", "AttentionLayout", "PackedCoreAttention", "attention_layout",
           "causal_attention"]

KERNELS = ("auto", "sdpa", "blockwise")

BLOCK_Q = 256
"""Queries per block: the score workspace is BLOCK_Q x K x H floats (K keys of the sequences in
the block). 256 x 8192 keys x 4 heads x 4 bytes = 32 MiB."""


# --------------------------------------------------------------------------------------------
# Layout: which keys each local query sees, and how the CP ranks' K/V are ordered


@dataclass(frozen=True)
class AttentionLayout:
    """Index tensors of one (micro-batch, CP rank); see :func:`attention_layout`.

    ``lo_Q``/``hi_Q``: first and last key (inclusive, in sequence order) query q may attend to.
    ``order_K``: gathered position -> sequence order (``k_seq = k_gathered[order_K]``), and
    ``gathered_of_K`` its inverse (``k_gathered = k_seq[gathered_of_K]``); None without CP.
    """

    lo_Q: torch.Tensor
    hi_Q: torch.Tensor
    order_K: Optional[torch.Tensor]
    gathered_of_K: Optional[torch.Tensor]


def attention_layout(cu_seqlens_padded: torch.Tensor, cp_rank: int = 0, cp_size: int = 1, *,
                     device=None) -> AttentionLayout:
    """The layout of a packed row ``cu_seqlens_padded`` (global, before the CP split).

    Without CP the local row is the whole pack. With CP every sequence length must be a multiple
    of ``2 * cp_size`` (``context_parallel.pad_cu_seqlens``) and rank r's local row is
    ``zigzag_indices(cu_seqlens_padded, r, cp_size)`` of the pack.
    """
    cu = cu_seqlens_padded.to(device="cpu", dtype=torch.long)
    total = int(cu[-1])
    seg_K = segment_ids(cu, total)
    start_K = cu[seg_K]  # start of each (global) token's sequence
    if cp_size == 1:
        hi_Q = torch.arange(total)
        order_K = gathered_of_K = None
    else:
        per_rank = [zigzag_indices(cu, r, cp_size) for r in range(cp_size)]
        hi_Q = per_rank[cp_rank]
        gathered_of_K = torch.cat(per_rank)  # gathered slot m holds sequence-order token [m]
        order_K = torch.argsort(gathered_of_K)
    lo_Q = start_K[hi_Q]
    device = device if device is not None else cu_seqlens_padded.device
    move = (lambda t: None if t is None else t.to(device))
    return AttentionLayout(move(lo_Q), move(hi_Q), move(order_K), move(gathered_of_K))


# --------------------------------------------------------------------------------------------
# The blockwise causal attention kernel (local math, no communication)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _BlockwiseAttention(torch.autograd.Function):
    """``out_q = sum_k softmax_k(scale q.k, k in [lo_q, hi_q]) v_k`` per head, with GQA."""

    @staticmethod
    def forward(ctx, q_QHD, k_KND, v_KND, lo_Q, hi_Q, scale: float, block: int):
        num_q, num_heads, _ = q_QHD.shape
        num_groups = k_KND.shape[1]
        per_group = num_heads // num_groups
        cdt = _compute_dtype(q_QHD.dtype)
        out_QHD = q_QHD.new_empty((num_q,) + tuple(q_QHD.shape[1:2]) + (v_KND.shape[-1],))
        lse_NGQ = torch.empty((num_groups, per_group, num_q), dtype=cdt, device=q_QHD.device)
        for q0, q1, k0, k1 in _blocks(lo_Q, hi_Q, block):
            q_qNGD = q_QHD[q0:q1].reshape(q1 - q0, num_groups, per_group, -1).to(cdt)
            s_NGqk = _masked_scores(q_qNGD, k_KND[k0:k1].to(cdt), lo_Q[q0:q1], hi_Q[q0:q1],
                                    k0, scale)
            m_NGq1 = s_NGqk.amax(dim=-1, keepdim=True)
            p_NGqk = torch.exp(s_NGqk - m_NGq1)
            l_NGq1 = p_NGqk.sum(dim=-1, keepdim=True)
            o_qNGD = torch.einsum("ngqk,knd->qngd", p_NGqk / l_NGq1, v_KND[k0:k1].to(cdt))
            out_QHD[q0:q1] = o_qNGD.reshape(q1 - q0, num_heads, -1).to(out_QHD.dtype)
            lse_NGQ[:, :, q0:q1] = (m_NGq1 + torch.log(l_NGq1)).squeeze(-1)
        ctx.save_for_backward(q_QHD, k_KND, v_KND, lo_Q, hi_Q, out_QHD, lse_NGQ)
        ctx.scale, ctx.block = scale, block
        return out_QHD

    @staticmethod
    def backward(ctx, grad_out_QHD):
        q_QHD, k_KND, v_KND, lo_Q, hi_Q, out_QHD, lse_NGQ = ctx.saved_tensors
        scale = ctx.scale
        num_q, num_heads, _ = q_QHD.shape
        num_groups = k_KND.shape[1]
        per_group = num_heads // num_groups
        cdt = lse_NGQ.dtype
        dq_QHD = torch.zeros(q_QHD.shape, dtype=cdt, device=q_QHD.device)
        dk_KND = torch.zeros(k_KND.shape, dtype=cdt, device=k_KND.device)
        dv_KND = torch.zeros(v_KND.shape, dtype=cdt, device=v_KND.device)
        for q0, q1, k0, k1 in _blocks(lo_Q, hi_Q, ctx.block):
            n = q1 - q0
            q_qNGD = q_QHD[q0:q1].reshape(n, num_groups, per_group, -1).to(cdt)
            k_kND, v_kND = k_KND[k0:k1].to(cdt), v_KND[k0:k1].to(cdt)
            do_qNGD = grad_out_QHD[q0:q1].reshape(n, num_groups, per_group, -1).to(cdt)
            o_qNGD = out_QHD[q0:q1].reshape(n, num_groups, per_group, -1).to(cdt)
            s_NGqk = _masked_scores(q_qNGD, k_kND, lo_Q[q0:q1], hi_Q[q0:q1], k0, scale)
            p_NGqk = torch.exp(s_NGqk - lse_NGQ[:, :, q0:q1, None])  # masked: exp(-inf) = 0
            dv_KND[k0:k1] += torch.einsum("ngqk,qngd->knd", p_NGqk, do_qNGD)
            dp_NGqk = torch.einsum("qngd,knd->ngqk", do_qNGD, v_kND)
            # softmax backward: dS = P (dP - rowsum(dO * O)), rowsum(P dP) = rowsum(dO * O)
            delta_NGq1 = (do_qNGD * o_qNGD).sum(-1).permute(1, 2, 0).unsqueeze(-1)
            ds_NGqk = p_NGqk * (dp_NGqk - delta_NGq1) * scale
            dq_QHD[q0:q1] = torch.einsum("ngqk,knd->qngd", ds_NGqk, k_kND).reshape(n, num_heads, -1)
            dk_KND[k0:k1] += torch.einsum("ngqk,qngd->knd", ds_NGqk, q_qNGD)
        return (dq_QHD.to(q_QHD.dtype), dk_KND.to(k_KND.dtype), dv_KND.to(v_KND.dtype),
                None, None, None, None)


def _blocks(lo_Q: torch.Tensor, hi_Q: torch.Tensor, block: int):
    """(q0, q1, k0, k1): query block and the key range its queries need."""
    num_q = lo_Q.numel()
    if num_q == 0:
        return
    starts = list(range(0, num_q, block))
    # one host sync for all blocks' key ranges
    lo_min = torch.stack([lo_Q[s:s + block].min() for s in starts]).tolist()
    hi_max = torch.stack([hi_Q[s:s + block].max() for s in starts]).tolist()
    for s, k0, k1 in zip(starts, lo_min, hi_max):
        yield s, min(s + block, num_q), int(k0), int(k1) + 1


def _masked_scores(q_qNGD, k_kND, lo_q, hi_q, k0: int, scale: float):
    s_NGqk = torch.einsum("qngd,knd->ngqk", q_qNGD, k_kND) * scale
    key_index_k = torch.arange(k0, k0 + k_kND.shape[0], device=k_kND.device)
    is_visible_qk = (key_index_k[None, :] >= lo_q[:, None]) & (key_index_k[None, :] <= hi_q[:, None])
    return s_NGqk.masked_fill(~is_visible_qk, float("-inf"))


def _sdpa_causal(q_QHD, k_KND, v_KND, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of every sequence of the pack by PyTorch's fused SDPA (no CP), GQA
    native (``enable_gqa``: K/V heads are not repeated, and autograd saves them unrepeated)."""
    def sdpa(q, k, v, batch):  # [batch * L, heads, D] each -> [batch * L, H, Dv]
        def heads_first(x):
            return x.reshape(batch, -1, x.shape[1], x.shape[2]).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v),
                                             is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    bounds = [int(x) for x in cu_seqlens.tolist()]
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if lengths and min(lengths) == max(lengths) > 0:  # equal rows: one batched call
        return sdpa(q_QHD, k_KND, v_KND, len(lengths))
    parts = [sdpa(q_QHD[a:b], k_KND[a:b], v_KND[a:b], 1)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if not parts:
        return q_QHD.new_empty(q_QHD.shape[:2] + v_KND.shape[-1:])
    return torch.cat(parts)


# --------------------------------------------------------------------------------------------
# K/V all-gather over the CP group (backward: reduce-scatter)


class _GatherKV(torch.autograd.Function):
    """Forward: all-gather the local K and V of every CP rank and put them in sequence order.
    Backward: back to gathered order, then reduce-scatter, so rank r receives the SUM over all
    ranks' queries of the gradient of its own tokens' K and V."""

    @staticmethod
    def forward(ctx, k_LND, v_LND, cp_group, order_K, gathered_of_K):
        dk = k_LND.shape[-1]
        kv_LNE = torch.cat([k_LND, v_LND], dim=-1).contiguous()
        parts = [torch.empty_like(kv_LNE) for _ in range(dist.get_world_size(cp_group))]
        dist.all_gather(parts, kv_LNE, group=cp_group)
        kv_KNE = torch.cat(parts).index_select(0, order_K)
        ctx.cp_group, ctx.dk, ctx.local = cp_group, dk, k_LND.shape[0]
        ctx.save_for_backward(gathered_of_K)
        return kv_KNE[..., :dk].contiguous(), kv_KNE[..., dk:].contiguous()

    @staticmethod
    def backward(ctx, grad_k_KND, grad_v_KND):
        (gathered_of_K,) = ctx.saved_tensors
        grad_KNE = torch.cat([grad_k_KND, grad_v_KND], dim=-1).index_select(0, gathered_of_K)
        grad_LNE = _reduce_scatter_rows(grad_KNE.contiguous(), ctx.cp_group)
        return grad_LNE[..., :ctx.dk], grad_LNE[..., ctx.dk:], None, None, None


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's equal share of the rows."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = x.shape[0] // size
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total[rank * rows:(rank + 1) * rows]
    out = x.new_empty((rows,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


# --------------------------------------------------------------------------------------------
# The function


def causal_attention(q_QHD: torch.Tensor, k_LND: torch.Tensor, v_LND: torch.Tensor,
                     cu_seqlens_padded: torch.Tensor, *, softmax_scale: Optional[float] = None,
                     cp_group: Optional[dist.ProcessGroup] = None,
                     layout: Optional[AttentionLayout] = None, block: int = BLOCK_Q,
                     kernel: str = "auto") -> torch.Tensor:
    """Causal attention of this rank's packed tokens ``[Q, H, D]`` (K/V ``[Q, N, D]``), GQA.

    ``cu_seqlens_padded``: the pack's sequence boundaries before any CP split (global). Under CP
    (``cp_group`` of size > 1) the local tokens are the zigzag share of this rank. ``kernel``:
    ``"auto"`` (SDPA without CP, blockwise with CP), ``"sdpa"`` (refused under CP) or
    ``"blockwise"`` (``block`` queries at a time). Returns ``[Q, H, Dv]``. Differentiable in
    q, k, v.
    """
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel must be one of {KERNELS}, got {kernel!r}")
    num_heads, num_groups = q_QHD.shape[1], k_LND.shape[1]
    if num_heads % num_groups != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_groups} key/value heads")
    cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
    cp_rank = dist.get_rank(cp_group) if cp_size > 1 else 0
    expected = int(cu_seqlens_padded[-1]) // cp_size
    if q_QHD.shape[0] != expected or k_LND.shape[0] != expected:
        raise ValueError(f"attention: {q_QHD.shape[0]} local tokens, but cu_seqlens[-1] = "
                         f"{int(cu_seqlens_padded[-1])} over {cp_size} context-parallel ranks "
                         f"means {expected}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_QHD.shape[-1])
    if kernel == "sdpa" and cp_size > 1:
        raise ValueError("attention kernel 'sdpa' cannot express the context-parallel zigzag "
                         "mask; use 'auto' or 'blockwise' under context parallelism")
    if kernel == "sdpa" or (kernel == "auto" and cp_size == 1):
        return _sdpa_causal(q_QHD, k_LND, v_LND, cu_seqlens_padded, scale)
    if layout is None:
        layout = attention_layout(cu_seqlens_padded, cp_rank, cp_size, device=q_QHD.device)
    if cp_size > 1:
        k_KND, v_KND = _GatherKV.apply(k_LND, v_LND, cp_group, layout.order_K, layout.gathered_of_K)
    else:
        k_KND, v_KND = k_LND, v_LND
    return _BlockwiseAttention.apply(q_QHD, k_KND, v_KND, layout.lo_Q, layout.hi_Q, scale, block)


# --------------------------------------------------------------------------------------------
# The Megatron module


class PackedCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for Megatron's local spec (see the module docstring).

    Same constructor as Megatron's ``DotProductAttention``. Supports what this project's models
    use: causal self-attention without dropout, bias, sliding windows or query-key layer scaling;
    anything else is refused at construction, not ignored.
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = [
            (attn_mask_type != AttnMaskType.causal, f"attn_mask_type {attn_mask_type}"),
            (attention_type != "self", f"attention_type {attention_type!r}"),
            (dropout != 0.0, f"attention_dropout {dropout}"),
            (bool(config.apply_query_key_layer_scaling), "apply_query_key_layer_scaling"),
            (config.window_size is not None, f"window_size {config.window_size}"),
            (config.softmax_type != "vanilla", f"softmax_type {config.softmax_type!r}"),
        ]
        refused = [what for bad, what in unsupported if bad]
        if refused:
            raise ValueError("PackedCoreAttention (local-spec attention) supports causal "
                             "self-attention only; unsupported: " + ", ".join(refused))
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.cp_group = pg_collection.cp
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention: attention_bias is not supported")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"PackedCoreAttention: attn_mask_type {attn_mask_type} (causal only)")
        if attention_mask is not None:
            # The causal structure comes from the layout; an explicit mask would be ignored.
            raise ValueError("PackedCoreAttention: explicit attention masks are not supported; "
                             "pass attention_mask=None (causal) and packed_seq_params for packing")
        cp_group = self.cp_group if self.cp_group is not None and self.cp_group.size() > 1 else None
        cp_size = cp_group.size() if cp_group is not None else 1
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"PackedCoreAttention: qkv_format "
                                 f"{packed_seq_params.qkv_format!r} (thd only)")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            out_QHD = causal_attention(query, key, value, cu, softmax_scale=self.softmax_scale,
                                       cp_group=cp_group)
            return out_QHD.reshape(out_QHD.shape[0], -1)
        # [s, b, h, d]: every row is one sequence of s * cp tokens (zigzag-split under CP)
        seq, batch = query.shape[0], query.shape[1]
        cu = torch.arange(batch + 1, device=query.device) * (seq * cp_size)

        def rows(x):
            return x.transpose(0, 1).reshape(batch * seq, x.shape[2], x.shape[3])

        out = causal_attention(rows(query), rows(key), rows(value), cu,
                               softmax_scale=self.softmax_scale, cp_group=cp_group)
        return out.reshape(batch, seq, -1).transpose(0, 1).contiguous()
