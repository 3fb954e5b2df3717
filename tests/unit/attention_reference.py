"""A naive per-sequence causal attention (float64), written independently of
``megatron_gspo.model.attention``: one sequence at a time, GQA by repeating K/V heads, a full
[len, len] score matrix with an upper-triangular mask."""

from __future__ import annotations

import math

import torch


def naive_causal_attention(q, k, v, cu_seqlens, scale=None):
    """q [T, H, D], k/v [T, N, D] packed per ``cu_seqlens``; returns [T, H, D] (float64)."""
    q, k, v = q.double(), k.double(), v.double()
    heads, groups = q.shape[1], k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.zeros(q.shape[0], heads, v.shape[-1], dtype=torch.float64)
    bounds = [int(x) for x in cu_seqlens]
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs = q[start:end].transpose(0, 1)                                 # [H, L, D]
        ks = k[start:end].repeat_interleave(heads // groups, dim=1).transpose(0, 1)
        vs = v[start:end].repeat_interleave(heads // groups, dim=1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) * scale                          # [H, L, L]
        length = end - start
        future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ vs).transpose(0, 1)
    return out
