"""One optimizer step on Megatron: DDP, optimizer, pipeline schedules, and THE loss-scaling contract.

Scaling contract
----------------
Every loss this project trains with is a mean over *units* (sequences for GSPO, tokens for SFT)
of the whole mini-batch, over all ranks::

    L = (1/N) * sum_u loss_u          N = number of units in the mini-batch on all DP ranks

N is counted before the step and all-reduced once over the data-parallel group (a sequence split
over context-parallel ranks is one unit). Megatron then applies two factors of its own:

* the schedule (``forward_step_calc_loss``, 3-tuple return, ``calculate_per_token_loss=False``)
  divides each micro-batch's returned loss by its returned count (we return 1) and by the number of
  micro-batches M;
* DDP pre-scales every gradient (dense and expert) by ``1 / |dp_cp|`` before summing it over the
  data(-and-context)-parallel group.

So ``loss_func`` returns, for the units u of its micro-batch on this rank::

    returned = sum_u loss_u * M * |dp_cp| / N

and the gradient that reaches the optimizer is exactly ``grad L``: summed over micro-batches and
dp_cp ranks, the factors M and |dp_cp| cancel. Under context parallelism every CP rank computes the
same loss value from all-reduced per-sequence sums whose backward is the identity (see
``context_parallel.SequenceAllReduce``), so each CP rank's backward covers its own tokens once and
the DDP sum over the CP ranks assembles the full gradient. Tensor-parallel ranks compute identical
losses and need no factor. ``tests/distributed/test_layouts.py`` checks the contract by comparing
every layout's gradients with the single-process run.

The MoE load-balancing loss keeps Megatron's own scaling (mean over micro-batches, DP-averaged).

Learning-rate schedule
----------------------
``build_train_state`` builds Megatron-Core's ``OptimizerParamScheduler`` from ``optim`` (warmup,
constant / linear / cosine decay to ``min_lr``; formulas in ``config.OptimConfig``) over the run's
optimizer steps, ``run.num_steps x updates_per_step`` (RL: ``gspo.updates_per_rollout``; SFT: 1).
``train_step`` advances it by one after every successful optimizer step (as Megatron's own
training loop does) and reports the LR the step used; the checkpoint saves and restores it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Optional

import torch
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import (OptimizerParamScheduler,
                                                     get_canonical_lr_for_logging)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megatron_gspo.config import Config, ConfigError, OptimConfig
from megatron_gspo.model.gpt import forward_kwargs
from megatron_gspo.parallel import collective_device
from megatron_gspo.train.finite_check import check_update


@dataclass
class TrainState:
    """What a training rank holds: the wrapped model chunks, the optimizer, its LR schedule, the
    groups. A forward-only model (the frozen reference policy) has no optimizer and no schedule."""

    model: list  # Megatron DDP-wrapped model chunks (one without virtual pipelining)
    optimizer: object
    pg_collection: object
    config: Config
    scheduler: object = None  # megatron.core.optimizer_param_scheduler.OptimizerParamScheduler
    params_behind: bool = False
    """True from an optimizer step with ``parallel.overlap_param_gather`` until
    :func:`gather_params`: other data-parallel ranks' shards of the model parameters may still
    hold the values before that step (Megatron gathers them at the next forward)."""

    @property
    def transformer_config(self):
        return get_model_config(self.model[0])


def build_optimizer_config(optim: OptimConfig, params_dtype: str):
    for name in ("optimizer_cpu_offload", "use_precision_aware_optimizer"):
        if getattr(optim, name) and not torch.cuda.is_available():
            raise ConfigError(f"optim.{name}: a GPU-only Megatron optimizer option (CUDA "
                              "optimizer kernels and host/GPU state copies); set it to false on CPU")
    if params_dtype != "float32" and not torch.cuda.is_available():
        raise ConfigError(
            f"model.params_dtype: {params_dtype} needs a GPU (Megatron's mixed-precision "
            "optimizer wraps only torch.cuda half/bfloat16 tensors); use float32 on a machine "
            "without CUDA")
    offload = {}
    if optim.optimizer_cpu_offload:
        # Megatron's HybridDeviceOptimizer: the host part steps while the next D2H/H2D copies run
        offload = dict(optimizer_cpu_offload=True,
                       optimizer_offload_fraction=optim.optimizer_offload_fraction,
                       overlap_cpu_optimizer_d2h_h2d=True)
    return OptimizerConfig(
        use_precision_aware_optimizer=optim.use_precision_aware_optimizer,
        **offload,
        optimizer=optim.optimizer,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=params_dtype == "bfloat16",
        params_dtype=torch.bfloat16 if params_dtype == "bfloat16" else torch.float32,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )


def wrap_model(gpt, config: Config, pg_collection) -> list:
    """Wrap one model chunk in Megatron's DDP (fp32 gradient reduction)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=config.parallel.overlap_grad_reduce,
        overlap_param_gather=config.parallel.overlap_param_gather,
        use_distributed_optimizer=config.optim.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt,
                                  pg_collection=pg_collection)
    return [ddp]


def build_scheduler(optimizer, optim: OptimConfig, num_steps: int, updates_per_step: int = 1):
    """Megatron's ``OptimizerParamScheduler`` over ``num_steps x updates_per_step`` optimizer steps.

    The config is the truth on resume (``override_opt_param_scheduler``): a checkpoint restores
    the position (optimizer steps taken), the shape comes from this run's ``optim`` section.
    Weight decay stays constant (Megatron multiplies it by each group's ``wd_mult``).
    """
    total = num_steps * updates_per_step
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,  # the warmup starts at 0 (Megatron's lr_warmup_init default)
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps * updates_per_step,
        lr_decay_steps=total,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(state: TrainState) -> float:
    """The LR the next optimizer step uses (Megatron's canonical group, as its logging reads it)."""
    lr = get_canonical_lr_for_logging(state.optimizer.param_groups)
    return float(lr if lr is not None else state.optimizer.param_groups[0]["lr"])


def build_train_state(gpt, config: Config, pg_collection, *, updates_per_step: int = 1) -> TrainState:
    """DDP + Megatron optimizer + LR schedule around an already built (and loaded) model chunk.

    ``updates_per_step``: optimizer steps per run step (RL: ``gspo.updates_per_rollout``), so
    that the schedule spans the run's ``run.num_steps x updates_per_step`` optimizer steps."""
    model = wrap_model(gpt, config, pg_collection)
    optimizer = get_megatron_optimizer(
        build_optimizer_config(config.optim, config.model.params_dtype), model,
        use_gloo_process_groups=False, pg_collection=pg_collection)
    tcfg = gpt.config
    tcfg.grad_scale_func = optimizer.scale_loss
    tcfg.no_sync_func = model[0].no_sync
    tcfg.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg_collection)
    scheduler = build_scheduler(optimizer, config.optim, config.run.num_steps, updates_per_step)
    return TrainState(model=model, optimizer=optimizer, pg_collection=pg_collection, config=config,
                      scheduler=scheduler)


def gathers_params_lazily(model: list) -> bool:
    """True when Megatron's distributed optimizer leaves the parameter all-gather of a step to
    the next forward (``parallel.overlap_param_gather``)."""
    return any(chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather
               for chunk in model)


def gather_params(state: TrainState) -> None:
    """Collective (each model chunk's data-parallel group): make every parameter hold what the
    last optimizer step computed, on every rank. The one call every reader of the weights goes
    through (``CheckpointedTrainer.current_policy``: the weight sync, checkpoints, the HF export).

    With ``parallel.overlap_param_gather``, ``DistributedOptimizer.step`` updates only this rank's
    shard of each parameter; the other ranks' shards arrive in the next forward's pre-hooks
    (megatron-core 0.16.1 ``distrib_optimizer.step_with_ready_grads``: "the first all-gather is
    launched asynchronously in the next optimizer.zero_grad() call and subsequent all-gathers
    are launched in the forward pre-hook"). A reader before that forward would see the previous
    step's values on every shard this rank does not own. ``start_param_sync(force_sync=True)``
    waits for a gather in flight or runs it synchronously, and marks it dispatched, so the next
    forward's pre-hooks gather nothing again: the bytes move once per step either way. Without
    a step since the last gather (``params_behind`` false), or without the overlap, nothing
    happens."""
    if not state.params_behind:
        return
    for chunk in state.model:
        if chunk.ddp_config.use_distributed_optimizer and chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
    state.params_behind = False


def loss_scale(num_microbatches: int, num_units_global: float, pg_collection) -> float:
    """The factor of the contract above: ``M * |dp_cp| / N`` (N > 0)."""
    if num_units_global <= 0:
        raise ValueError("the mini-batch has no loss units (every sequence is padding)")
    return num_microbatches * pg_collection.dp_cp.size() / float(num_units_global)


def global_unit_count(local_count: float, pg_collection) -> float:
    """N: the number of loss units over all data-parallel ranks (one all-reduce over DP, not CP).

    With context parallelism a sequence's tokens sit on several CP ranks; count it once with
    ``loss_scaling.global_num_sequences`` (it reduces the counts over CP first)."""
    count = torch.tensor([float(local_count)], dtype=torch.float64, device=collective_device())
    torch.distributed.all_reduce(count, group=pg_collection.dp)
    return float(count.item())


def model_device(model) -> torch.device:
    """Where the model chunk's parameters live: this rank's GPU, or the CPU."""
    return next(model.parameters()).device


def batch_to_device(batch: dict, device: torch.device) -> dict:
    """Move every tensor of a micro-batch to ``device`` IN PLACE and return the same dict.

    The one place where batches meet the device (RL and SFT): micro-batches are built on the
    host (``batching``), and the dict is the one the loss function reads and writes, e.g. the
    RL trainer's recompute pass stores ``old_log_probs`` in it for the update that follows."""
    for key, value in batch.items():
        if torch.is_tensor(value) and value.device != device:
            batch[key] = value.to(device, non_blocking=True)
    return batch


def forward_step(data_iterator, model, *, device: torch.device, loss_func, pg_collection=None,
                 routing=None):
    """Megatron's ``forward_step_func``: next micro-batch, onto the device, through the model
    (packed sequences and response-only logits: ``model.gpt.forward_kwargs``). ``routing``
    (``model.routing_replay.RoutingPass``): its ``before_forward(batch)`` / ``after_forward(batch)``
    run right around this stage's forward of the micro-batch (routing replay and capture)."""
    batch = batch_to_device(next(data_iterator), device)
    if routing is not None:
        routing.before_forward(batch)
    output = model(batch["tokens"], batch["position_ids"], None,
                   **forward_kwargs(batch, pg_collection))
    if routing is not None:
        routing.after_forward(batch)
    return output, partial(loss_func, batch)


# A micro-batch is a dict with at least "tokens" and "position_ids" ([b, s] int64); the loss
# function receives the last stage's vocab-parallel logits [b, s, V/tp] and the micro-batch and
# returns (sum of unit losses on this rank, metrics dict of detached scalars).
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def forward_backward(state: TrainState, microbatches: list[dict], loss_fn: LossFn, *,
                     num_units_global: float, forward_only: bool = False,
                     routing=None) -> list[dict]:
    """Run Megatron's schedule over the micro-batches; returns the last stage's metric dicts.
    ``routing``: the per-micro-batch routing hooks of ``forward_step``."""
    num_microbatches = len(microbatches)
    scale = loss_scale(num_microbatches, num_units_global, state.pg_collection)
    seq_length = microbatches[0]["tokens"].shape[1]
    micro_batch_size = microbatches[0]["tokens"].shape[0]
    for mb in microbatches:
        # packed micro-batches differ in length (pipeline stages exchange shapes first:
        # variable_seq_lengths in model.gpt.build_transformer_config)
        if "cu_seqlens_padded" not in mb and tuple(mb["tokens"].shape) != (micro_batch_size,
                                                                            seq_length):
            raise ValueError("every micro-batch must have the same [micro_batch_size, seq_length] "
                             f"shape for the pipeline schedule; got {tuple(mb['tokens'].shape)} and "
                             f"{(micro_batch_size, seq_length)}")

    def loss_func(batch, output_tensor):
        local_sum, metrics = loss_fn(output_tensor, batch)
        metrics = dict(metrics)
        metrics["loss_sum"] = local_sum.detach()
        return local_sum * scale, torch.ones((), dtype=torch.int), metrics

    # Megatron's forward_only does not disable autograd: without no_grad every forward-only pass
    # (log pi_old, the reference policy, held-out losses) would save a training step's activations
    with torch.no_grad() if forward_only else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=partial(forward_step, device=model_device(state.model[0]),
                                      loss_func=loss_func, pg_collection=state.pg_collection,
                                      routing=routing),
            data_iterator=iter(microbatches),
            model=state.model,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )


def train_step(state: TrainState, microbatches: list[dict], loss_fn: LossFn, *,
               num_units_global: float, routing=None) -> dict:
    """Zero grads, forward/backward over the micro-batches, the finite check, optimizer step, LR
    schedule step.

    A non-finite loss term or gradient on any rank raises ``finite_check.NonFiniteError`` on
    every rank BEFORE the optimizer step (Megatron's FP32 and bf16 optimizers would apply it:
    ``megatron_gspo.train.finite_check``); the parameters, the optimizer state and the schedule
    are then untouched. Returns ``per_microbatch`` (the loss function's metrics), ``grad_norm``,
    ``update_successful`` (False only when a grad scaler skipped the update: fp16, which this
    project does not use) and ``lr`` (the learning rate this step used)."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = forward_backward(state, microbatches, loss_fn, num_units_global=num_units_global,
                              routing=routing)
    check_update(losses, state.model)
    lr = current_lr(state)
    # from here until gather_params (or the next forward) other ranks' shards may be behind
    state.params_behind = state.params_behind or gathers_params_lazily(state.model)
    update_successful, grad_norm, _ = state.optimizer.step()
    if update_successful and state.scheduler is not None:
        state.scheduler.step(1)  # as Megatron's loop: a skipped (inf/NaN) update does not count
    return {"per_microbatch": losses, "grad_norm": grad_norm, "update_successful": update_successful,
            "lr": lr}


def sum_metric(per_microbatch: Iterable[dict], key: str) -> Optional[float]:
    values = [float(m[key]) for m in per_microbatch if key in m]
    return sum(values) if values else None
