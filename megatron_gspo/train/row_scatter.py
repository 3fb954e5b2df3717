"""Rank 0's rows to the ranks that need them, each rank only its own (a collective on gloo).

The routing-replay tensor of one RL step (``gspo.routing_replay: rollout``: the experts the
rollout servers routed every token to, ``[rows, T, layers, top-k]``) is 2.0 GB at Qwen3-30B-A3B
and 3.9 GB at 235B. Broadcast with the rest of the batch it would be pickled once and sent whole
to every rank; a rank trains on one data-parallel share of the rows. :func:`scatter_rows` sends
each rank exactly the rows it names, as raw bytes (no pickling), one point-to-point message per
rank from rank 0; the indices travel first, gathered on rank 0 as small objects.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo.collectives import on_rank0


def scatter_rows(full: Optional[torch.Tensor], needed: torch.Tensor, row_shape: tuple[int, ...],
                 dtype: torch.dtype, *, group=None) -> torch.Tensor:
    """Collective over ``group`` (every rank calls it; CPU tensors, a gloo group): rank 0 holds
    ``full`` (``[rows, *row_shape]``, None elsewhere); every rank names the rows it needs
    (``needed``, int64) and receives them, ``[len(needed), *row_shape]`` of ``dtype``, in the
    order of ``needed``. Rank 0 checks ``full``'s shape and that every named row exists, and
    converts it to ``dtype`` (the values must fit)."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    needed = needed.to(torch.long)
    everyone: list = [None] * world if rank == 0 else None
    dist.gather_object(needed.tolist(), everyone, dst=0, group=group)
    shape = (len(needed), *row_shape)
    # rank 0 checks before any send (a wrong shape must not leave the other ranks in recv)
    on_rank0(_check, full, everyone, row_shape, group=group)
    if rank != 0:
        out = torch.empty(shape, dtype=dtype)
        if out.numel():
            dist.recv(_bytes(out), src=_global(0, group), group=group)
        return out
    full = full.to(dtype)
    for peer in range(1, world):
        rows = torch.tensor(everyone[peer], dtype=torch.long)
        if len(rows):
            dist.send(_bytes(full[rows].contiguous()), dst=_global(peer, group), group=group)
    return full[needed].clone()


def _check(full: Optional[torch.Tensor], everyone: list, row_shape: tuple) -> None:
    """Rank 0: a ValueError unless ``full`` has rows of ``row_shape`` and every row a rank names."""
    if full is None:
        raise ValueError("rank 0 holds no tensor to scatter")
    if tuple(full.shape[1:]) != tuple(row_shape):
        raise ValueError(f"rows of shape {tuple(full.shape[1:])} to scatter, the ranks expect "
                         f"{tuple(row_shape)}")
    for peer, rows in enumerate(everyone):
        bad = [r for r in rows if not 0 <= r < full.shape[0]]
        if bad:
            raise ValueError(f"rank {peer} asks for rows {bad[:8]} of a tensor of "
                             f"{full.shape[0]} rows")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (gloo sends every dtype that way)."""
    return t.reshape(-1).view(torch.uint8)


def _global(group_rank: int, group) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
