"""Supervised fine-tuning of the policy on prompt/response pairs (the paper's cold start).

The loss is the mean negative log-likelihood of the RESPONSE tokens (and the end token) over the
whole global batch (units are tokens; ``train_step`` applies the scaling contract). Pairs come from
``data``: the synthetic task (prompt, exact answer), or a JSONL / Parquet file whose
``data.prompt_key`` holds the prompt and ``data.label_key`` the response. Every rank builds the same
global batch for a step from the seeded sampler, and each data-parallel rank trains on its share,
so a run is deterministic and independent of the layout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo import model as policy
from megatron_gspo.config import Config
from megatron_gspo.train_step import (TrainState, build_train_state, forward_backward,
                                      global_unit_count, train_step)
from pipeline.batching import right_pad, split_for_rank
from pipeline.metrics import MetricsLogger
from pipeline.tasks import PAD_ID


def sft_pairs(prompts: list, encoder) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids + end token) for Prompts whose label is the response."""
    pairs = []
    for prompt in prompts:
        if prompt.label is None:
            raise ValueError(f"{prompt.origin}: no response (data.label_key) to fine-tune on")
        pairs.append((prompt.prompt_ids, encoder.encode_text(prompt.label) + [encoder.eos_id]))
    return pairs


def sft_batch(pairs: list[tuple[list[int], list[int]]], seq_length: int) -> dict[str, torch.Tensor]:
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
    tokens = right_pad(rows, seq_length + 1, PAD_ID)
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
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total.item()) / num_units


@dataclass
class SFTResult:
    losses: list[float]
    eval_losses: list[float]
    gpt: object = None


def evaluate(state: TrainState, cfg: Config, eval_pairs: list) -> float:
    """Mean response-token NLL on the held-out pairs (forward only)."""
    pg = state.pg_collection
    batch = sft_batch(eval_pairs, cfg.run.seq_length)
    mbs = split_for_rank(batch, pg.dp.rank(), pg.dp.size(), 1)
    units = global_unit_count(float(mbs[0]["loss_mask"].sum()), pg)
    out = forward_backward(state, mbs, nll_loss_fn(cfg.model, pg), num_units_global=units,
                           forward_only=True)
    return global_loss(out, pg, units)


def run_sft(cfg: Config, pg_collection, *, logger: MetricsLogger) -> SFTResult:
    """Train ``cfg.run.num_steps`` SFT steps of the tiny policy; returns the loss curve."""
    pg = pg_collection
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=cfg.run.seed)
    state = build_train_state(gpt, cfg, pg)
    from pipeline.data import PromptSampler, build_datasets

    train_set, eval_set = build_datasets(cfg.data, seed=cfg.run.seed)
    sampler = PromptSampler(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    eval_pairs = sft_pairs([eval_set[i] for i in range(len(eval_set))], train_set.encoder) \
        if eval_set is not None else None
    dp_rank, dp_size = pg.dp.rank(), pg.dp.size()
    gbs, mbs_size = cfg.run.global_batch_size, cfg.run.micro_batch_size
    if gbs % (mbs_size * dp_size) != 0:
        raise ValueError(f"run.global_batch_size {gbs} is not a multiple of run.micro_batch_size "
                         f"{mbs_size} x data-parallel size {dp_size}")
    num_microbatches = gbs // (mbs_size * dp_size)
    losses, eval_losses = [], []
    if eval_pairs:
        eval_losses.append(evaluate(state, cfg, eval_pairs))
        logger.log(0, {"eval/loss": eval_losses[0]},
                   progress=f"step 0/{cfg.run.num_steps}  held-out loss {eval_losses[0]:.4f}")
    for step in range(1, cfg.run.num_steps + 1):
        start = time.monotonic()
        batch = sft_batch(sft_pairs(sampler.next_batch(gbs), train_set.encoder), cfg.run.seq_length)
        mbs = split_for_rank(batch, dp_rank, dp_size, num_microbatches)
        units = global_unit_count(sum(float(mb["loss_mask"].sum()) for mb in mbs), pg)
        out = train_step(state, mbs, nll_loss_fn(cfg.model, pg), num_units_global=units)
        loss = global_loss(out["per_microbatch"], pg, units)
        losses.append(loss)
        elapsed = time.monotonic() - start
        metrics = {"train/loss": loss, "train/grad_norm": out["grad_norm"],
                   "train/tokens_per_s": gbs * cfg.run.seq_length / elapsed, "train/step_s": elapsed}
        progress = (f"step {step}/{cfg.run.num_steps}  loss {loss:.4f}  "
                    f"grad_norm {out['grad_norm']:.3f}  {elapsed:.2f}s/step")
        if eval_pairs and (cfg.run.eval_interval and step % cfg.run.eval_interval == 0
                           or step == cfg.run.num_steps):
            eval_losses.append(evaluate(state, cfg, eval_pairs))
            metrics["eval/loss"] = eval_losses[-1]
            progress += f"  held-out loss {eval_losses[-1]:.4f}"
        if step % cfg.run.log_interval == 0 or step == cfg.run.num_steps:
            logger.log(step, metrics, progress=progress)
        else:
            logger.log(step, metrics)
    return SFTResult(losses=losses, eval_losses=eval_losses, gpt=gpt)
