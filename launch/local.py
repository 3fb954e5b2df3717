"""Start a command's training ranks on this machine when no launcher (torchrun, srun) did.

``ensure_ranks(args, world_size)`` returns None inside a launched rank (RANK / WORLD_SIZE or
SLURM_PROCID set, or world_size == 1); otherwise it re-runs the same command under
``torch.distributed.run --standalone`` with ``world_size`` local ranks and returns its exit code.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional


def is_launched() -> bool:
    return "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def ensure_ranks(subcommand_argv: list[str], world_size: int) -> Optional[int]:
    if is_launched() or world_size == 1:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world_size}", "-m", "launch.cli", *subcommand_argv]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(f"starting {world_size} local ranks: {' '.join(cmd[1:])}", flush=True)
    return subprocess.call(cmd, env=env)
