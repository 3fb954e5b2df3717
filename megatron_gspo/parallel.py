"""Process groups: validate the parallel layout against the world size, initialise Megatron's groups.

The layout is ``world = tensor x context x pipeline x data`` for the dense part, and for the experts
``world = expert_tensor x expert x pipeline x expert_data``; the data-parallel sizes are derived.
:func:`initialize` returns Megatron's :class:`ProcessGroupCollection`, which the rest of the code
receives explicitly (no module reads ``parallel_state`` globals on its own).
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gspo import cpu_compat
from megatron_gspo.config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class Layout:
    """Every parallel factor of one run (derived from the config and the world size)."""

    world_size: int
    tensor: int
    context: int
    pipeline: int
    expert: int
    expert_tensor: int
    data: int
    expert_data: int

    def describe(self) -> str:
        return (f"world {self.world_size} = tensor {self.tensor} x context {self.context} x "
                f"pipeline {self.pipeline} x data {self.data}; experts: expert_tensor "
                f"{self.expert_tensor} x expert {self.expert} x pipeline {self.pipeline} x "
                f"expert_data {self.expert_data}")


def derive_layout(parallel: ParallelConfig, world_size: int) -> Layout:
    """Derive data-parallel sizes; the error shows every factor against WORLD_SIZE."""
    tp, cp, pp, ep, etp = (parallel.tensor, parallel.context, parallel.pipeline, parallel.expert,
                           parallel.expert_tensor_size())
    dense = tp * cp * pp
    expert = etp * ep * pp
    if world_size % dense != 0:
        raise ConfigError(
            f"WORLD_SIZE {world_size} is not divisible by parallel.tensor {tp} x parallel.context "
            f"{cp} x parallel.pipeline {pp} = {dense}")
    if world_size % expert != 0:
        raise ConfigError(
            f"WORLD_SIZE {world_size} is not divisible by parallel.expert_tensor {etp} x "
            f"parallel.expert {ep} x parallel.pipeline {pp} = {expert}")
    return Layout(world_size=world_size, tensor=tp, context=cp, pipeline=pp, expert=ep,
                  expert_tensor=etp, data=world_size // dense, expert_data=world_size // expert)


def init_distributed(timeout_minutes: int = 10) -> None:
    """Start torch.distributed from the usual env (torchrun, srun, or a single process)."""
    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", 0)))
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(minutes=timeout_minutes))


def initialize(parallel: ParallelConfig, *, seed: int = 1234):
    """Initialise Megatron's model-parallel groups for ``parallel``; returns ProcessGroupCollection.

    ``torch.distributed`` must already be initialised (see :func:`init_distributed`). Applies the
    CPU accommodations first when CUDA is absent.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    cpu_compat.apply()
    layout = derive_layout(parallel, dist.get_world_size())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor,
        pipeline_model_parallel_size=layout.pipeline,
        context_parallel_size=layout.context,
        expert_model_parallel_size=layout.expert,
        expert_tensor_parallel_size=layout.expert_tensor,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    if cpu_compat.is_applied():
        cpu_compat.seed_rng_tracker()
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_model_parallel() -> None:
    """Tear down Megatron's groups (torch.distributed stays up)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def destroy() -> None:
    """Tear down Megatron's groups and torch.distributed."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def minimal_world_size(parallel: ParallelConfig) -> int:
    """The smallest world that holds the layout with data parallelism 1 (dense and experts)."""
    dense = parallel.tensor * parallel.context * parallel.pipeline
    experts = parallel.expert_tensor_size() * parallel.expert * parallel.pipeline
    return dense * experts // math.gcd(dense, experts)
