"""``megatron-gspo plan``: the predicted peak GPU memory of a training rank, per pipeline stage.

    megatron-gspo plan --config launch/configs/qwen3_30b_a3b.yaml --world-size 16 --gpu-memory-gib 80

Prints, for every pipeline stage, the itemised peak (weights, fp32 gradients, optimizer states,
activations per micro-batch with the configured recompute, the 1F1B schedule's in-flight
micro-batches, logits and the log-prob workspace, communication buffers), then the rollout
servers' side (the update groups' buffers, the memory of one server GPU, in the terms of
``rollout.engine``, with bf16 and with FP8
weights, and the modelled weight-sync pause per step of the distributed and the disk transport:
megatron_gspo/rollout_plan.py) and ends with one line
``fits: yes|no (peak X GiB of M GiB, stage S)``. Exit status 0 when it fits, 1 when it does not,
2 for an invalid configuration. ``train`` (on GPUs) and ``launch slurm`` (with GPUs) run the same
plan and refuse a layout that does not fit unless given ``--ignore-memory-plan``. The arithmetic
and its checks: megatron_gspo/plan.py and docs/performance.md ("Memory plan").
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

from launch.common import add_config_args, load_from_args
from megatron_gspo.mcore_compat import transformer_engine_available
from megatron_gspo.parallel import minimal_world_size
from megatron_gspo.plan import GIB, check_fits, plan_memory
from megatron_gspo.rollout_plan import SyncAssumptions


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="predicted peak GPU memory per pipeline stage",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--world-size", type=int, default=None,
                   help="training ranks (GPUs); default: the smallest world the layout needs")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0,
                   help="memory of one GPU in GiB (default 80: H100; 141 for H200)")
    p.add_argument("--spec", choices=("te", "local"), default="te",
                   help="layer implementation: te (Transformer Engine, GPUs) or local "
                        "(Megatron's local spec, as on CPU) (default te)")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="X",
                   help="tokens of the busiest expert rank over the mean (default 1: balanced "
                        "routing; RL without an aux loss can reach 1.5)")
    p.add_argument("--sync-assume", action="append", default=[], metavar="NAME=VALUE",
                   help="a parameter of the weight-sync model (repeatable), e.g. fs_read_gbps=3 "
                        "for NFS; the plan prints them all with their values "
                        "(megatron_gspo/rollout_plan.py: SyncAssumptions, each with its source)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_from_args(args)
    world = args.world_size if args.world_size is not None else minimal_world_size(cfg.parallel)
    plan = plan_memory(cfg, world, args.gpu_memory_gib, spec=args.spec,
                       moe_imbalance=args.moe_imbalance,
                       sync_assumptions=SyncAssumptions.parse(args.sync_assume))
    print(plan.format())
    return 0 if plan.fits else 1


def check_training_memory(cfg, world_size: int, *, proceed: bool, env=None,
                          device_memory_gib: Optional[float] = None) -> Optional[str]:
    """``train``'s check before it starts a rank: on a GPU, the plan for this world against this
    GPU's memory; refuses (PlanDoesNotFit, exit 2) unless ``proceed``. Returns the verdict line
    (None on a machine without CUDA: CPU runs are not planned). Under srun / torchrun the world
    is theirs (WORLD_SIZE / SLURM_NTASKS)."""
    if device_memory_gib is None:
        if not torch.cuda.is_available():
            return None
        device_memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", world_size)))
    spec = "te" if transformer_engine_available() else "local"
    plan = check_fits(cfg, world, device_memory_gib, proceed=proceed, spec=spec)
    return plan.verdict()
