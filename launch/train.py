"""``megatron-gspo train``: the GSPO loop on Megatron with SGLang-protocol rollout servers.

On one machine (ranks and, in embedded mode, the rollout servers and the router are started for
you; they are always stopped, also on error or Ctrl-C)::

    megatron-gspo train --config launch/configs/tiny_cpu.yaml --set run.init_from=runs/sft/hf

Under torchrun or srun, one process per training rank, with ``rollout.mode: external`` and
``rollout.router_url`` pointing at a running SGLang router (worker URLs are read from it).

Everything that can be checked before the start is (``launch.preflight``: data files and their
lengths, the reward function, the batch splits, an external router, the run directory's lock);
an input error exits 2 with one message, also when a rank finds it later.

``--resume`` continues from the newest checkpoint in ``run.output_dir`` (model, optimizer, RNG,
data position, step); without a checkpoint there it says so and starts at step 0 (a Slurm job
passes --resume on every start, the first included). SIGTERM, SIGINT (Ctrl-C) and SIGUSR1 -
to this command, to torchrun, to a rank, or to all of them at once - finish the current step,
save a checkpoint and exit with status 75 ("requeue me") at every level; a finished run exits 0.
(Under Slurm the job keeps srun from answering a SIGTERM of its own by killing the ranks,
`scancel --signal=TERM --full` included: slurm/README.md.)
One run per ``run.output_dir``: a second one is refused, naming the first (``launch.run_lock``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launch import local
from launch.common import add_config_args, load_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="GSPO reinforcement learning on Megatron",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in run.output_dir (if there is one)")
    p.add_argument("--nproc", type=int, default=None,
                   help="local training ranks to start when not launched by torchrun/srun "
                        "(default: the smallest world the parallel layout needs)")
    p.add_argument("--ignore-memory-plan", action="store_true",
                   help="start even when the memory plan (megatron-gspo plan) says the layout "
                        "does not fit this GPU")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = load_from_args(args)
    from launch import preflight
    from megatron_gspo.parallel import minimal_world_size

    world = args.nproc or minimal_world_size(cfg.parallel)
    preflight.before_ranks(cfg, program="train", world_size=world,
                           resume=args.resume)  # input errors: exit 2 here
    from launch.plan import check_training_memory

    check_training_memory(cfg, world, proceed=args.ignore_memory_plan)  # GPUs only; exit 2
    code = local.ensure_ranks(argv, world, log_dir=Path(cfg.run.output_dir) / "logs")
    if code is not None:
        return code
    from launch.rl_session import run_training

    return run_training(cfg, resume=args.resume)
