"""The Megatron side of the RL loop: one object per training rank that owns the policy.

``RLTrainer.train_rollout(batch, step)`` is the GSPO update of one rollout batch:

1. the global batch (every rank holds the same one, broadcast by the loop) is cut into
   k = ``gspo.updates_per_rollout`` mini-batches (a seeded permutation of its rows, then contiguous
   slices), each mini-batch into this data-parallel rank's micro-batches: padded rows of
   ``run.micro_batch_size``, or with ``run.max_tokens_per_micro_batch`` whole sequences packed
   under that token budget (THD), balanced over the data-parallel ranks. Under context
   parallelism each rank keeps its zigzag share of every row / sequence
   (``megatron_gspo.train.batching``). The output layer runs on response positions only
   (``logit_index``);
2. log pi_old is recomputed by Megatron for EVERY mini-batch before the first update (forward only),
   together with the policy's entropy. The objective under staleness (docs/gspo_math.md):
   ``gspo.old_logprobs: recompute`` is the decoupled form, pi_old the proximal policy (these
   weights at the start of the step) in s_i and the batch's per-token ``rollout_log_probs`` (the
   behaviour policy, of whichever weight versions sampled the tokens) in the truncated behaviour
   weight m_i; ``rollout`` is the bypass form, the rollout's log-probs are pi_old and there is no
   weight (the forward pass still runs, for the entropy, the rollout/trainer gap and routing);
   With ``gspo.kl_coef > 0`` the frozen reference policy (a second copy of the INITIAL policy,
   same layout, never updated) then computes log pi_ref for the same micro-batches, in the same
   forward-only way, for the k3 KL term of ``gspo_loss``;
3. k optimizer steps, each the gradient of ``(1/N_j) sum_i loss_i`` over mini-batch j
   (``train_step`` documents the scaling contract; N_j counted over DP x CP, each sequence once:
   ``loss_scaling.global_num_sequences``; the per-sequence sums of GSPO all-reduced over the CP
   group: ``context_parallel.make_sequence_reduce``); the LR schedule advances once per update and
   ``lr`` reports the learning rate of the batch's last update.

Routing (docs/routing.md). With ``gspo.routing_replay: old`` the forward of step 2 records every
MoE router's top-k experts per micro-batch and the training forwards of step 3 replay them; with
``rollout`` both replay the batch's ``routed_experts`` (the rollout servers' experts,
``[rows, T, num_layers, topk]`` aligned with ``tokens``, -1 where unknown), cut into micro-batches,
CP shares and SP slices with the tokens. With ``gspo.routing_metrics`` a last forward-only pass over
the same micro-batches after the k-th update (replaying as the training forwards do) gives
``routing_change_frac*`` (the routers' own top-k sets, old vs updated policy) and the variances of
log w_it and log s_i (``megatron_gspo.train.routing_metrics``).

Metrics come back reduced over all micro-batches, mini-batches and ranks, each as its kind needs
(token fractions weighted by tokens, sequence means by sequences, extremes as extremes:
``megatron_gspo.train.metric_reduction``). ``entropy_mean`` and ``rollout_trainer_logprob_abs_diff``
are those of pi_old over the whole rollout batch (the forward-only pass of step 2).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch

from megatron_gspo.model import gpt as policy
from megatron_gspo.config import Config, validate_data_parallel
from megatron_gspo.hf.gather import HFGather, sender_ranks
from megatron_gspo.train.initial_weights import is_mcore_checkpoint, load_initial_weights  # noqa: F401
from megatron_gspo.loss.context_parallel import make_sequence_reduce
from megatron_gspo.loss.loss_scaling import global_num_sequences, global_num_tokens
from megatron_gspo.loss.variants import TOKEN_NORMALIZED_VARIANTS
from megatron_gspo.model.routing_replay import MoERouting, RoutingPass
from megatron_gspo.train.rl_loss import make_gspo_loss_fn, make_log_prob_fn
from megatron_gspo.train.train_step import (TrainState, build_train_state, current_lr,
                                            forward_backward, train_step)
from megatron_gspo.train.checkpoint import CheckpointedTrainer
from megatron_gspo.train.finite_check import NonFiniteError
from megatron_gspo.train.batching import (add_logit_index, loss_rows, pack_micro_batch,
                                          plan_micro_batches, response_counts, sequence_lengths,
                                          split_rows_for_context_parallel, take_rows,
                                          validate_routed_experts)
from megatron_gspo.train.metric_reduction import reduce_metrics
from megatron_gspo.train.routing_metrics import log_ratio_stats, routing_change_metrics
from megatron_gspo.train.row_scatter import scatter_rows
from megatron_gspo.train.scoring import score_log_probs

_OLD_POLICY_METRICS = ("entropy_mean", "rollout_trainer_logprob_abs_diff")


def _policy_metrics(mb, log_probs, entropy, cp_group) -> dict:
    """The forward-only pass's metrics of one micro-batch, with the counts they are weighted by
    (``entropy_mean`` as ``gspo_loss`` defines it: the mean over sequences of H_i). Per-sequence
    sums over this rank's tokens, all-reduced over the context-parallel group, so that every CP
    rank reports the values of the whole sequences."""
    mask = loss_rows(mb, mb["response_mask"], fill_value=False).bool()
    entropy = loss_rows(mb, entropy)
    diff = loss_rows(mb, (log_probs - mb["rollout_log_probs"]).abs())
    sums = torch.stack([mask.sum(-1).to(entropy.dtype), torch.where(mask, entropy, 0.0).sum(-1),
                        torch.where(mask, diff, 0.0).sum(-1)], dim=-1)  # [S, 3]
    if cp_group is not None and cp_group.size() > 1:
        torch.distributed.all_reduce(sums, group=cp_group)
    n_i = sums[:, 0]
    num_sequences, num_tokens = (n_i > 0).sum(), n_i.sum()
    per_sequence_entropy = sums[:, 1] / n_i.clamp_min(1)  # H_i
    abs_diff = sums[:, 2].sum()
    return {"num_sequences": float(num_sequences), "num_tokens": float(num_tokens),
            "entropy_mean": float(per_sequence_entropy.sum() / num_sequences.clamp_min(1)),
            "rollout_trainer_logprob_abs_diff": float(abs_diff / num_tokens.clamp_min(1))}


def ratio_log_probs(gspo_cfg, recomputed: torch.Tensor, mb: dict) -> torch.Tensor:
    """log pi_old of the ratio s_i (``mb["old_log_probs"]``), docs/gspo_math.md "The objective
    under staleness": the recomputed log-probs of the proximal policy (this step's starting
    weights) with ``gspo.old_logprobs: recompute`` (decoupled), the batch's recorded behaviour
    log-probs ``rollout_log_probs`` with ``rollout`` (bypass)."""
    if gspo_cfg.old_logprobs == "recompute":
        return recomputed.detach()
    return mb["rollout_log_probs"]


class RLTrainer(CheckpointedTrainer):
    """Owns this rank's policy stage, its optimizer and the GSPO update."""

    def __init__(self, cfg: Config, pg_collection, *, init_hf_dir: Optional[str] = None):
        self.cfg = cfg
        self.pg = pg_collection
        validate_data_parallel(cfg, pg_collection.dp.size())
        self.gpt = policy.build_model(cfg.model, cfg.parallel, pg_collection)
        load_initial_weights(self.gpt, cfg.model, pg_collection, init_hf_dir, seed=cfg.run.seed)
        self.routing = None
        """The policy's MoE routers (``model.routing_replay.MoERouting``), when the step replays
        or measures routing."""
        if cfg.gspo.routing_replay != "none" or cfg.gspo.routing_metrics:
            self.routing = MoERouting(self.gpt, pg_collection)
        self.reference = self._build_reference() if cfg.gspo.kl_coef > 0 else None
        self.state = build_train_state(self.gpt, cfg, pg_collection,
                                       updates_per_step=cfg.gspo.updates_per_rollout)
        self.resumed_from: Optional[Path] = None
        """The checkpoint ``load`` restored (kept by ``run.keep_checkpoints`` rotation)."""

    def _build_reference(self) -> TrainState:
        """The frozen reference policy: a second model chunk in the same layout holding a copy of
        the initial weights (so resuming a run keeps the reference of its start). No DDP, no
        optimizer, no gradients; it runs in the policy's (train) mode, so that at the first update
        pi_ref equals the recomputed pi_old bit for bit."""
        reference = policy.build_model(self.cfg.model, self.cfg.parallel, self.pg)
        reference.load_state_dict(self.gpt.state_dict(), strict=True)
        reference.requires_grad_(False)
        return TrainState(model=[reference], optimizer=None, pg_collection=self.pg, config=self.cfg)

    def _num_microbatches(self, rows: int) -> int:
        dp = self.pg.dp.size()
        mbs = self.cfg.run.micro_batch_size
        if rows % (dp * mbs) != 0:
            raise ValueError(f"a mini-batch of {rows} sequences does not split into data-parallel "
                             f"size {dp} x run.micro_batch_size {mbs} (run.global_batch_size / "
                             "gspo.updates_per_rollout rows per mini-batch)")
        return rows // (dp * mbs)

    def row_plan(self, batch: dict, step: int) -> list[list[torch.Tensor]]:
        """The batch rows (int64 indices) of each of this rank's micro-batches of each of the k
        mini-batches: a seeded permutation cut into k mini-batches (layout-independent), each
        split over the data-parallel ranks (padded rows: equal slices; packed: the plan of
        ``batching.plan_micro_batches``, the same on every rank). Needs only the small per-row
        fields of ``batch`` (``tokens``' shape, the lengths), not the routed experts."""
        rows = batch["tokens"].shape[0]
        k = self.cfg.gspo.updates_per_rollout
        if rows % k != 0:
            raise ValueError(f"rollout batch of {rows} sequences does not split into "
                             f"gspo.updates_per_rollout = {k} mini-batches")
        gen = torch.Generator().manual_seed(self.cfg.run.seed * 100_003 + step)
        order = torch.randperm(rows, generator=gen)
        size = rows // k
        pg = self.pg
        dp_rank, dp = pg.dp.rank(), pg.dp.size()
        budget = self.cfg.run.max_tokens_per_micro_batch
        lengths = sequence_lengths(batch) if budget is not None else None
        plan = []
        for j in range(k):
            mini = order[j * size:(j + 1) * size]
            if budget is not None:
                mine = plan_micro_batches(lengths[mini].tolist(), budget, dp, cp_size=pg.cp.size(),
                                          tp_size=pg.tp.size())[dp_rank]
                plan.append([mini[torch.tensor(list(ix), dtype=torch.long)] for ix in mine])
            else:
                num = self._num_microbatches(size)
                per_mb = size // dp // num
                start = dp_rank * (size // dp)
                plan.append([mini[start + i * per_mb:start + (i + 1) * per_mb] for i in range(num)])
        return plan

    def minibatches(self, batch: dict, step: int) -> list[list[dict]]:
        """This rank's micro-batches of each of the k mini-batches (:meth:`row_plan`)."""
        return [[self.micro_batch(batch, rows) for rows in mini]
                for mini in self.row_plan(batch, step)]

    def micro_batch(self, batch: dict, rows: torch.Tensor) -> dict:
        """The micro-batch of ``rows`` of ``batch`` as this rank holds it (padded rows: its CP
        share of each row; packed: one pack, its CP share), with the response positions where
        the output layer runs. ``batch`` may hold only some rows' routed experts
        (:meth:`scatter_routed_experts`)."""
        pg = self.pg
        cp_rank, cp, tp = pg.cp.rank(), pg.cp.size(), pg.tp.size()
        part = take_rows(batch, rows)
        if self.cfg.run.max_tokens_per_micro_batch is not None:
            mb = pack_micro_batch(part, range(len(rows)), cp_rank=cp_rank, cp_size=cp, tp_size=tp)
        else:
            mb = split_rows_for_context_parallel(part, cp_rank, cp, tp)
        return add_logit_index(mb)

    def scatter_routed_experts(self, batch: dict, step: int, group=None) -> None:
        """Collective over ``group`` (gloo): rank 0's ``batch["routed_experts"]`` (every row,
        ``[B, T, layers, top-k]``: 2 GB per step at 30B) reaches each rank as the rows of its
        own micro-batches only (:meth:`row_plan`): ``batch["routed_experts"]`` then holds those
        rows and ``batch["routed_rows"]`` their indices, on every rank, rank 0 included. One
        data-parallel rank's share per rank instead of the whole tensor to every rank."""
        needed = torch.cat([rows for mini in self.row_plan(batch, step) for rows in mini]
                           ).unique(sorted=True)
        model = self.cfg.model
        shape = (batch["tokens"].shape[1], model.num_layers, model.moe_router_topk)
        full = batch.pop("routed_experts", None)
        batch["routed_experts"] = scatter_rows(full, needed, shape, torch.int16, group=group)
        batch["routed_rows"] = needed

    def _routing_pass(self, *, replay: bool, capture_key: Optional[str] = None):
        """The per-micro-batch routing hooks of one pass (None when nothing is replayed or
        captured): replay ``replay_topk`` when ``replay``, capture the routers' own top-k."""
        if self.routing is None or (not replay and capture_key is None):
            return None

        return RoutingPass(self.routing, replay_key="replay_topk" if replay else None,
                           capture_key=capture_key)

    def _recompute_old_log_probs(self, minibatches: list[list[dict]]) -> dict:
        """Forward only: log pi_old for every micro-batch (stored in the dicts); returns the
        reduced ``entropy_mean`` and ``rollout_trainer_logprob_abs_diff`` of pi_old. Replays the
        rollout's experts with ``gspo.routing_replay: rollout``; records the routers' top-k
        (``routing_old``) for replay ``old`` and for the routing metrics."""
        temperature = self.cfg.rollout.temperature

        def loss_fn(logits, mb):
            with torch.no_grad():
                log_probs, entropy = policy.micro_batch_log_probs(
                    logits, mb, self.cfg.model, self.pg, temperature=temperature,
                    with_entropy=True)
            mb["old_log_probs"] = ratio_log_probs(self.cfg.gspo, log_probs, mb)
            return log_probs.new_zeros(()), _policy_metrics(mb, log_probs, entropy, self.pg.cp)

        gspo = self.cfg.gspo
        capture = gspo.routing_replay == "old" or gspo.routing_metrics
        routing = self._routing_pass(replay=gspo.routing_replay == "rollout",
                                     capture_key="routing_old" if capture else None)
        collected = []
        for microbatches in minibatches:
            collected += forward_backward(self.state, microbatches, loss_fn, num_units_global=1,
                                          forward_only=True, routing=routing)
        if gspo.routing_replay == "old":
            for mb in (mb for microbatches in minibatches for mb in microbatches):
                mb["replay_topk"] = mb["routing_old"]
        return reduce_metrics(collected, self.pg)

    def _after_update_metrics(self, minibatches: list[list[dict]]) -> dict:
        """Forward only, after the step's last update, over the same micro-batches (replaying as
        the training forwards do): routing volatility and the log-ratio variances
        (``megatron_gspo.train.routing_metrics``), reduced."""
        temperature = self.cfg.rollout.temperature

        def loss_fn(logits, mb):
            log_probs, _ = policy.micro_batch_log_probs(logits, mb, self.cfg.model, self.pg,
                                                        temperature=temperature)
            return log_probs.new_zeros(()), log_ratio_stats(mb, log_probs, self.pg.cp)

        routing = self._routing_pass(replay=self.cfg.gspo.routing_replay != "none",
                                     capture_key="routing_new")
        collected = []
        for microbatches in minibatches:
            stats = forward_backward(self.state, microbatches, loss_fn, num_units_global=1,
                                     forward_only=True, routing=routing)
            changes = routing_change_metrics(microbatches, self.routing, self.pg,
                                             self.cfg.model.num_layers)
            if stats:  # the last pipeline stage: one dict per micro-batch, in order
                changes = [{**c, **s} for c, s in zip(changes, stats, strict=True)]
            collected += changes
        return reduce_metrics(collected, self.pg)

    def _reference_log_probs(self, minibatches: list[list[dict]]) -> None:
        """Forward only on the frozen reference: log pi_ref for every micro-batch, stored as
        ``ref_log_probs`` in the dicts (last pipeline stage), at the rollout temperature like
        pi_old."""
        loss_fn = make_log_prob_fn(self.cfg.model, self.pg, key="ref_log_probs",
                                   temperature=self.cfg.rollout.temperature)
        for microbatches in minibatches:
            forward_backward(self.reference, microbatches, loss_fn, num_units_global=1,
                             forward_only=True)

    def train_rollout(self, batch: dict, step: int) -> dict:
        """The k GSPO updates of one rollout batch; returns reduced metrics."""
        start = time.monotonic()
        gspo = self.cfg.gspo
        if gspo.routing_replay == "rollout":
            model = self.cfg.model
            validate_routed_experts(batch, model.num_layers, model.moe_router_topk,
                                    model.num_experts)
        minibatches = self.minibatches(batch, step)
        if gspo.routing_replay == "rollout":
            for mb in (mb for microbatches in minibatches for mb in microbatches):
                mb["replay_topk"] = self.routing.targets_from_batch(mb["routed_experts"])
        old_policy_metrics = self._recompute_old_log_probs(minibatches)
        if self.reference is not None:
            self._reference_log_probs(minibatches)
        loss_fn = make_gspo_loss_fn(self.cfg.model, self.cfg.gspo, self.pg,
                                    temperature=self.cfg.rollout.temperature,
                                    sequence_reduce=make_sequence_reduce(self.pg.cp))
        update_metrics, grad_norms, lr = [], [], None
        routing = self._routing_pass(replay=gspo.routing_replay != "none")
        for j, microbatches in enumerate(minibatches):
            count = (global_num_tokens if gspo.variant in TOKEN_NORMALIZED_VARIANTS
                     else global_num_sequences)  # the loss's units: tokens or sequences
            n_global = count([response_counts(mb) for mb in microbatches],
                             dp_group=self.pg.dp, cp_group=self.pg.cp)
            if n_global == 0:
                continue
            try:
                out = train_step(self.state, microbatches, loss_fn, num_units_global=n_global,
                                 routing=routing)
            except NonFiniteError as err:  # not applied; the loop stops before the weight sync
                err.add_note(f"step {step}: update {j + 1}/{len(minibatches)}")
                raise
            update_metrics += out["per_microbatch"]
            lr = out["lr"]
            grad_norms.append(float(out["grad_norm"]) if out["grad_norm"] is not None else 0.0)
        metrics = reduce_metrics(update_metrics, self.pg)
        # One meaning per name: entropy_mean is the policy's BEFORE this step's updates (the
        # forward-only pass), also when gspo.entropy_coef > 0 makes the loss report its own.
        metrics.update({k: old_policy_metrics[k] for k in _OLD_POLICY_METRICS})
        metrics["grad_norm"] = max(grad_norms) if grad_norms else 0.0
        metrics["lr"] = lr if lr is not None else current_lr(self.state)
        if gspo.routing_metrics:
            after = self._after_update_metrics(minibatches)
            metrics.update({k: v for k, v in after.items()
                            if k not in ("num_tokens", "num_sequences")})
        elapsed = time.monotonic() - start
        # the sequences' own tokens (prompt + response), not the padding of the rows
        num_tokens = batch["lengths"].sum() if "lengths" in batch else batch["tokens"].numel()
        metrics["train_tokens_per_s"] = float(num_tokens) / max(elapsed, 1e-9)
        metrics["train_s"] = elapsed
        return metrics

    # ---------------------------------------------------------------------------------------
    def hf_buckets(self):
        """Collective: the live policy as a stream of full Hugging Face tensor buckets
        (``megatron_gspo.hf.gather.BucketStream``) on their sending ranks; every rank iterates it
        to the end. Bucket size ``rollout.weight_sync.bucket_mb``, dtype
        ``rollout.weight_sync.dtype``; the plan and the buffers are made once and kept."""
        if getattr(self, "_hf_gather", None) is None:
            rollout = self.cfg.rollout
            dtype = getattr(torch, rollout.weight_sync.dtype) if rollout.weight_sync.dtype else None
            senders = sender_ranks(rollout.weight_sync.resolved_senders(),
                                   self.pg.pp.rank())
            self._hf_gather = HFGather(self.cfg.model,
                                       bucket_bytes=rollout.weight_sync.bucket_mb << 20,
                                       dtype=dtype, senders=senders)
        return self._hf_gather.buckets(self.current_policy(), self.pg)

    # --- scoring given sequences (the parity watchdog, calibrate-eps) ---------------------------
    def score_log_probs(self, batch: dict, *, temperature: float = 1.0) -> torch.Tensor:
        """Collective: ``[R, T]`` log pi(labels) of the live policy at ``temperature`` on the
        response positions of ``batch`` (``batching.rl_batch`` rows; 0 elsewhere), the same on
        every rank (``megatron_gspo.train.scoring``)."""
        return score_log_probs(self.state, batch, self.cfg.model, self.pg,
                               micro_batch_size=self.cfg.run.micro_batch_size,
                               temperature=temperature)
