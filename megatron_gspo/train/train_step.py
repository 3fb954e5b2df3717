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
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Optional

import torch

from megatron_gspo.config import Config, OptimConfig


@dataclass
class TrainState:
    """What a training rank holds: the wrapped model chunks, the optimizer, the groups."""

    model: list  # Megatron DDP-wrapped model chunks (one without virtual pipelining)
    optimizer: object
    pg_collection: object
    config: Config

    @property
    def transformer_config(self):
        from megatron.core.utils import get_model_config

        return get_model_config(self.model[0])


def build_optimizer_config(optim: OptimConfig, params_dtype: str):
    from megatron.core.optimizer import OptimizerConfig

    if optim.use_distributed_optimizer and not torch.cuda.is_available():
        raise RuntimeError(
            "optim.use_distributed_optimizer: Megatron's distributed optimizer needs CUDA tensors; "
            "set it to false on a machine without a GPU")
    return OptimizerConfig(
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
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=config.optim.use_distributed_optimizer,
    )
    ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt,
                                  pg_collection=pg_collection)
    return [ddp]


def build_train_state(gpt, config: Config, pg_collection) -> TrainState:
    """DDP + Megatron optimizer around an already built (and loaded) model chunk."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer

    model = wrap_model(gpt, config, pg_collection)
    optimizer = get_megatron_optimizer(
        build_optimizer_config(config.optim, config.model.params_dtype), model,
        use_gloo_process_groups=False, pg_collection=pg_collection)
    tcfg = gpt.config
    tcfg.grad_scale_func = optimizer.scale_loss
    tcfg.no_sync_func = model[0].no_sync
    tcfg.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg_collection)
    return TrainState(model=model, optimizer=optimizer, pg_collection=pg_collection, config=config)


def loss_scale(num_microbatches: int, num_units_global: float, pg_collection) -> float:
    """The factor of the contract above: ``M * |dp_cp| / N`` (N > 0)."""
    if num_units_global <= 0:
        raise ValueError("the mini-batch has no loss units (every sequence is padding)")
    return num_microbatches * pg_collection.dp_cp.size() / float(num_units_global)


def global_unit_count(local_count: float, pg_collection) -> float:
    """N: the number of loss units over all data-parallel ranks (one all-reduce over DP, not CP).

    With context parallelism a sequence's tokens sit on several CP ranks; count it once with
    ``loss_scaling.global_num_sequences`` (it reduces the counts over CP first)."""
    count = torch.tensor([float(local_count)], dtype=torch.float64)
    torch.distributed.all_reduce(count, group=pg_collection.dp)
    return float(count.item())


# A micro-batch is a dict with at least "tokens" and "position_ids" ([b, s] int64); the loss
# function receives the last stage's vocab-parallel logits [b, s, V/tp] and the micro-batch and
# returns (sum of unit losses on this rank, metrics dict of detached scalars).
LossFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict]]


def forward_backward(state: TrainState, microbatches: list[dict], loss_fn: LossFn, *,
                     num_units_global: float, forward_only: bool = False) -> list[dict]:
    """Run Megatron's schedule over the micro-batches; returns the last stage's metric dicts."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    num_microbatches = len(microbatches)
    scale = loss_scale(num_microbatches, num_units_global, state.pg_collection)
    seq_length = microbatches[0]["tokens"].shape[1]
    micro_batch_size = microbatches[0]["tokens"].shape[0]
    for mb in microbatches:
        if tuple(mb["tokens"].shape) != (micro_batch_size, seq_length):
            raise ValueError("every micro-batch must have the same [micro_batch_size, seq_length] "
                             f"shape for the pipeline schedule; got {tuple(mb['tokens'].shape)} and "
                             f"{(micro_batch_size, seq_length)}")

    def loss_func(batch, output_tensor):
        local_sum, metrics = loss_fn(output_tensor, batch)
        metrics = dict(metrics)
        metrics["loss_sum"] = local_sum.detach()
        return local_sum * scale, torch.ones((), dtype=torch.int), metrics

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None)
        return output, partial(loss_func, batch)

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=state.model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(state: TrainState, microbatches: list[dict], loss_fn: LossFn, *,
               num_units_global: float) -> dict:
    """Zero grads, forward/backward over the micro-batches, optimizer step. Returns metrics."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = forward_backward(state, microbatches, loss_fn, num_units_global=num_units_global)
    update_successful, grad_norm, _ = state.optimizer.step()
    return {"per_microbatch": losses, "grad_norm": grad_norm, "update_successful": update_successful}


def sum_metric(per_microbatch: Iterable[dict], key: str) -> Optional[float]:
    values = [float(m[key]) for m in per_microbatch if key in m]
    return sum(values) if values else None
