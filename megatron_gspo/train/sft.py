"""Supervised fine-tuning of the policy on prompt/response pairs (the paper's cold start).

The loss is the mean negative log-likelihood of the RESPONSE tokens (and the end token) over the
whole global batch (units are tokens; ``train_step`` applies the scaling contract). This module is the
Megatron side: :class:`SFTTrainer` builds the policy and its optimizer and trains on the
(prompt ids, response ids) pairs it is given; the loop that samples them from the data and logs
lives in ``pipeline/step/sft_loop.py``. Every rank is given the same global batch for a step, and each
data-parallel rank trains on its share, so a run is deterministic and independent of the layout.

The initial weights are ``run.init_from`` (a Hugging Face directory or a Megatron checkpoint) or
the ``run.seed`` initialisation, loaded as the RL trainer loads them
(``megatron_gspo.train.initial_weights``); checkpoints (``save`` / ``load``) hold the model, the
optimizer, the LR schedule and the RNG (``megatron_gspo.train.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo.model import gpt as policy
from megatron_gspo.config import Config, validate_data_parallel, validate_sft_context_parallel
from megatron_gspo.parallel import collective_device
from megatron_gspo.train.initial_weights import load_initial_weights
from megatron_gspo.train.train_step import (TrainState, build_train_state, forward_backward,
                                      global_unit_count, train_step)
from megatron_gspo.train.checkpoint import CheckpointedTrainer
from megatron_gspo.train.batching import right_pad, split_for_rank


def sft_batch(pairs: list[tuple[list[int], list[int]]], seq_length: int, *,
              pad_id: int) -> dict[str, torch.Tensor]:
    """Rows ``prompt + response``; the loss covers the response (label positions)."""
    rows, masks = [], []
    for i, (prompt_ids, response_ids) in enumerate(pairs):
        ids = list(prompt_ids) + list(response_ids)
        if len(ids) > seq_length + 1:
            raise ValueError(f"run.seq_length {seq_length} is too short for example {i}: prompt "
                             f"{len(prompt_ids)} + response {len(response_ids)} tokens")
        rows.append(ids)
        # label position t predicts token t + 1: the response starts at label len(prompt) - 1
        masks.append([0] * (len(prompt_ids) - 1) + [1] * len(response_ids))
    tokens = right_pad(rows, seq_length + 1, pad_id)
    loss_mask = right_pad(masks, seq_length, 0).bool()
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq_length).expand(len(pairs), seq_length).contiguous(),
        "loss_mask": loss_mask,
    }


def nll_loss_fn(model_cfg, pg_collection):
    """Sum over masked label positions of -log p(label)."""

    def loss_fn(logits, batch):
        log_probs, _ = policy.token_log_probs(logits, batch["labels"], model_cfg, pg_collection)
        mask = batch["loss_mask"].to(log_probs.dtype)
        return -(log_probs * mask).sum(), {}

    return loss_fn


def global_loss(per_microbatch: list[dict], pg_collection, num_units: float) -> float:
    """The step's loss ``(1/N) sum_u loss_u``, known on every rank (one all-reduce over the world).

    Loss sums live on the last pipeline stage; tensor- and context-parallel ranks hold copies, so
    only their rank 0 contributes.
    """
    counts = (pg_collection.pp.rank() == pg_collection.pp.size() - 1
              and pg_collection.tp.rank() == 0 and pg_collection.cp.rank() == 0)
    local = sum(float(m["loss_sum"]) for m in per_microbatch) if counts else 0.0

    total = torch.tensor([local], dtype=torch.float64, device=collective_device())
    dist.all_reduce(total)
    return float(total.item()) / num_units



class SFTTrainer(CheckpointedTrainer):
    """The policy under supervised fine-tuning: model, optimizer, one step, held-out loss."""

    def __init__(self, cfg: Config, pg_collection, *, pad_id: int):
        self.cfg, self.pg, self.pad_id = cfg, pg_collection, pad_id
        validate_data_parallel(cfg, pg_collection.dp.size())
        validate_sft_context_parallel(cfg.parallel)
        self.gpt = policy.build_model(cfg.model, cfg.parallel, pg_collection)
        load_initial_weights(self.gpt, cfg.model, pg_collection, cfg.run.init_from,
                             seed=cfg.run.seed)
        self.state: TrainState = build_train_state(self.gpt, cfg, pg_collection)
        self.resumed_from: Optional[Path] = None
        """The checkpoint ``load`` restored (kept by ``run.keep_checkpoints`` rotation)."""
        self.num_microbatches = cfg.run.global_batch_size // (cfg.run.micro_batch_size
                                                              * pg_collection.dp.size())

    def train_batch(self, pairs: list[tuple[list[int], list[int]]]) -> dict[str, float]:
        """One optimizer step on the global batch ``pairs``: ``{"loss", "grad_norm", "lr"}``
        (``lr``: the learning rate of this step)."""
        pg = self.pg
        batch = sft_batch(pairs, self.cfg.run.seq_length, pad_id=self.pad_id)
        mbs = split_for_rank(batch, pg.dp.rank(), pg.dp.size(), self.num_microbatches)
        units = global_unit_count(sum(float(mb["loss_mask"].sum()) for mb in mbs), pg)
        out = train_step(self.state, mbs, nll_loss_fn(self.cfg.model, pg), num_units_global=units)
        return {"loss": global_loss(out["per_microbatch"], pg, units), "grad_norm": out["grad_norm"],
                "lr": out["lr"]}

    def eval_loss(self, pairs: list[tuple[list[int], list[int]]]) -> float:
        """Mean response-token NLL on held-out ``pairs`` (forward only)."""
        pg = self.pg
        batch = sft_batch(pairs, self.cfg.run.seq_length, pad_id=self.pad_id)
        mbs = split_for_rank(batch, pg.dp.rank(), pg.dp.size(), 1)
        units = global_unit_count(float(mbs[0]["loss_mask"].sum()), pg)
        out = forward_backward(self.state, mbs, nll_loss_fn(self.cfg.model, pg),
                               num_units_global=units, forward_only=True)
        return global_loss(out, pg, units)
