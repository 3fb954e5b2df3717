"""Cutting a global batch into each data-parallel rank's micro-batches (pure torch).

A batch is a dict of tensors whose first dimension is the sequence (row). The global batch of a
step is the same on every rank (generated or loaded deterministically); each data-parallel rank
takes a contiguous share of rows and cuts it into equal micro-batches for Megatron's schedule.
"""

from __future__ import annotations

import torch


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
