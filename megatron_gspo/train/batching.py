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


def rl_batch(prompts: list[list[int]], outputs: list[list[int]], rollout_log_probs: list[list[float]],
             advantages: torch.Tensor, seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Training rows for sampled responses (one row per sample).

    ``tokens = prompt + output`` (right-padded), ``labels`` the next tokens, ``response_mask`` True
    at label positions that are output tokens, ``rollout_log_probs`` the rollout engine's
    log-probs at those positions (0 elsewhere). Raises ValueError if a sample does not fit.
    """
    rows, masks, rollout = [], [], []
    for i, (prompt, output, lps) in enumerate(zip(prompts, outputs, rollout_log_probs)):
        ids = list(prompt) + list(output)
        if len(ids) - 1 > seq_length:
            raise ValueError(f"sample {i}: prompt {len(prompt)} + response {len(output)} tokens "
                             f"exceed run.seq_length + 1 = {seq_length + 1}")
        if len(lps) != len(output):
            raise ValueError(f"sample {i}: {len(lps)} log-probs for {len(output)} output tokens")
        start = len(prompt) - 1  # label position of the first output token
        rows.append(ids)
        masks.append([0] * start + [1] * len(output))
        rollout.append([0.0] * start + list(lps))
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
    }


def select_rows(batch: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index].clone() for k, v in batch.items()}
