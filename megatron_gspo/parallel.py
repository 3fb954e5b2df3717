"""Process groups: validate the parallel layout against the world size, initialise Megatron's groups.

The layout is ``world = tensor x context x pipeline x data`` for the dense part, and for the experts
``world = expert_tensor x expert x pipeline x expert_data``; the data-parallel sizes are derived.
:func:`initialize` returns Megatron's :class:`ProcessGroupCollection`, which the rest of the code
receives explicitly (no module reads ``parallel_state`` globals on its own).

Groups on GPUs (:func:`init_distributed`): the default group is ``cpu:gloo,cuda:nccl`` (every
Megatron subgroup inherits both, so a host tensor in a small all-reduce cannot hit NCCL), the
training collectives use tensors on :func:`collective_device`, and rank 0's host-side control
traffic (rollout batches, outcomes, stop flags) has a gloo group of its own with its own, long
timeout; both timeouts are ``parallel.*_timeout_minutes``.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo import cpu_compat
from megatron_gspo.bound_store import check_reachable, tcp_store
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


def default_backend(cuda: bool) -> str:
    """The default group's backend: NCCL for CUDA tensors AND gloo for CPU tensors on GPUs.

    Megatron's subgroups inherit it, so a small host-side all-reduce (a stop flag, a count made
    on the CPU) works on every group instead of failing with "No backend type associated with
    device type cpu"; CUDA tensors still go through NCCL. Object collectives pick the CPU (gloo)
    backend of a group that has one. Without CUDA, gloo alone."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def collective_device() -> torch.device:
    """Where the tensors of a training collective live: this rank's GPU, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_device_index(env=None, device_count: Optional[int] = None) -> int:
    """This task's GPU: LOCAL_RANK (torchrun), else SLURM_LOCALID (srun), else 0. A site that binds
    one GPU per task shows every task a single device 0: the launcher then exports LOCAL_RANK=0
    (``launch slurm --gpu-binding task``)."""
    env = os.environ if env is None else env
    index = int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))
    count = torch.cuda.device_count() if device_count is None else device_count
    if index >= count:
        raise RuntimeError(
            f"local rank {index} but this task sees {count} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')}); on a site that binds one GPU per task "
            "launch with `launch slurm --gpu-binding task` (or set LOCAL_RANK=0)")
    return index


def nodes_in_world(env=None) -> int:
    """How many nodes the ranks of this run are on, as their launcher says: torchrun's
    GROUP_WORLD_SIZE (its agents, one per node), srun's SLURM_STEP_NUM_NODES / SLURM_NNODES
    (for ranks srun started: SLURM_PROCID set); 1 otherwise."""
    env = os.environ if env is None else env
    if env.get("GROUP_WORLD_SIZE"):
        return int(env["GROUP_WORLD_SIZE"])
    if "SLURM_PROCID" in env:
        for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
            if env.get(name):
                return int(env[name])
    return 1


def init_distributed(parallel: Optional[ParallelConfig] = None):
    """Start torch.distributed from the usual env (torchrun, srun, or a single process) and return
    the host-side control group.

    Timeouts come from ``parallel`` (defaults of :class:`ParallelConfig` without one): every
    training group gets ``distributed_timeout_minutes`` (NCCL's watchdog on GPUs); the control
    group, gloo over the whole world, gets ``control_timeout_minutes``. Rank 0's rollout batches,
    outcomes and the stop flag travel on it (``pipeline.context.LoopContext.control_group``), so
    ranks 1..N wait for rank 0's long rollouts, evaluations and disk syncs in gloo, never inside
    an NCCL collective. When torch.distributed is already up (tests), only the control group is
    created. Collective: every rank calls it.
    """
    parallel = parallel or ParallelConfig()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
        world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", 1)))
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # one process, no port given: its store takes any free port (no other rank has to find
        # it; a local multi-rank run gets one from torchrun --standalone), not a fixed one that
        # another run may hold
        any_port = world_size == 1 and "MASTER_PORT" not in os.environ and not agent_store
        os.environ.setdefault("MASTER_PORT", "29500")
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_device_index())
        timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
        store = None
        if not agent_store:
            # no torchrun agent hosts the store (srun, one process): rank 0 does, listening on
            # MASTER_ADDR only (env:// would listen on every interface); under torchrun the
            # ranks are the agent's clients (launch.torchrun_agent binds its stores)

            if rank == 0:  # the store listens on MASTER_ADDR: the other nodes must reach it
                check_reachable(os.environ["MASTER_ADDR"], nodes=nodes_in_world())

            port = 0 if any_port else int(os.environ["MASTER_PORT"])
            store = tcp_store(os.environ["MASTER_ADDR"], port,
                              is_master=rank == 0, world_size=world_size, timeout=timeout)
            if any_port:
                os.environ["MASTER_PORT"] = str(store.port)
        dist.init_process_group(backend=default_backend(cuda), store=store, rank=rank,
                                world_size=world_size, timeout=timeout)
    return dist.new_group(backend="gloo",
                          timeout=datetime.timedelta(minutes=parallel.control_timeout_minutes))


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
        distributed_timeout_minutes=parallel.distributed_timeout_minutes,
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
