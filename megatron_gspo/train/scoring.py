"""Per-token log-probs of given sequences under the live policy, as one tensor on every rank.

``score_log_probs(state, batch, ...)`` is a collective over the world: every rank passes the same
padded batch (``train.batching.rl_batch``'s rows: ``tokens``, ``labels``, ``position_ids``,
``response_mask``; ``[R, T]``) and gets back ``[R, T]`` float32 log pi(labels) at the response
positions (0 elsewhere), identical on every rank whatever the parallel layout. Used by the parity
watchdog (``pipeline/weights/parity.py``: the trainer's side of the server/trainer comparison) and by
``megatron-gspo calibrate-eps`` (s_i before and after one update).

How: the rows are padded (copies of row 0, dropped again) to a multiple of DP x
``micro_batch_size``, cut into this data-parallel rank's padded-row micro-batches
(``split_for_rank``) and their context-parallel zigzag share (``split_rows_for_context_parallel``)
- the layout the RL update uses without ``run.max_tokens_per_micro_batch`` - and run forward only
through Megatron's schedule with the log-prob function of the RL loss
(``rl_loss.make_log_prob_fn`` -> ``model.gpt.micro_batch_log_probs``, output layer at the response
positions only). On the last pipeline stage, tensor-parallel rank 0 (its TP peers hold copies)
writes each micro-batch's values back at (row, ``position_ids``) of a zero ``[R', T]`` tensor;
the data-parallel ranks hold disjoint rows and the context-parallel ranks disjoint positions, so
one SUM all-reduce over the world assembles the whole tensor everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.config import ModelConfig
from megatron_gspo.train.batching import add_logit_index, split_for_rank, split_rows_for_context_parallel
from megatron_gspo.train.rl_loss import make_log_prob_fn
from megatron_gspo.train.train_step import forward_backward, model_device

SCORE_KEYS = ("tokens", "labels", "position_ids", "response_mask")


def score_log_probs(state, batch: dict, model: ModelConfig, pg_collection, *,
                    micro_batch_size: int, temperature: float = 1.0) -> torch.Tensor:
    """Collective: ``[R, T]`` log-probs of ``batch["labels"]`` at ``response_mask`` (0 elsewhere)."""
    missing = [k for k in SCORE_KEYS if k not in batch]
    if missing:
        raise ValueError(f"score_log_probs: the batch lacks {missing}")
    rows, length = batch["tokens"].shape
    if rows == 0:
        return torch.zeros(0, length)
    pg = pg_collection
    dp, mbs = pg.dp.size(), micro_batch_size
    padded_rows = -(-rows // (dp * mbs)) * dp * mbs
    scored = {k: batch[k] for k in SCORE_KEYS}
    scored["row"] = torch.arange(padded_rows)
    if padded_rows > rows:  # copies of row 0 (real tokens: every micro-batch has logits to compute)
        fill = torch.zeros(padded_rows - rows, dtype=torch.long)
        scored = {k: (torch.cat([v, v[fill]]) if k != "row" else v) for k, v in scored.items()}
    num_microbatches = padded_rows // (dp * mbs)
    microbatches = [add_logit_index(split_rows_for_context_parallel(mb, pg.cp.rank(), pg.cp.size(),
                                                                    pg.tp.size()))
                    for mb in split_for_rank(scored, pg.dp.rank(), dp, num_microbatches)]
    loss_fn = make_log_prob_fn(model, pg, key="scored_log_probs", temperature=temperature)
    forward_backward(state, microbatches, loss_fn, num_units_global=1, forward_only=True)

    device = model_device(state.model[0])  # the default group's device (NCCL: CUDA)
    out = torch.zeros(padded_rows, length, dtype=torch.float32, device=device)
    writes = pg.pp.rank() == pg.pp.size() - 1 and pg.tp.rank() == 0
    for mb in microbatches:
        if not writes:
            break
        values = mb["scored_log_probs"].to(device, torch.float32)  # [b, T'/cp]
        positions = mb["position_ids"].to(device)
        keep = mb["response_mask"].to(device).bool() & (positions < length)  # CP pads the rows
        row_index = mb["row"].to(device)[:, None].expand_as(positions)
        out.index_put_((row_index[keep], positions[keep]), values[keep], accumulate=True)
    dist.all_reduce(out)
    return out[:rows].cpu()
