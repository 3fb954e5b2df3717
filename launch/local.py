"""Start a command's training ranks on this machine when no launcher (torchrun, srun) did; keep the console rank 0's.

``ensure_ranks(argv, world_size, log_dir=RUN_DIR / "logs")`` returns None inside a launched rank
(WORLD_SIZE or SLURM_PROCID set, or world_size == 1); otherwise it re-runs the same command under
torchrun (``launch.torchrun_agent``, ``--standalone``) with ``world_size`` local ranks, passes the
stop signals on and returns the command's exit status (``launch.supervise``).

The console belongs to rank 0. Each other rank writes its stdout and stderr (Python's and the C
libraries', file descriptors 1 and 2) to ``log_dir/rank<N>.log``, appended, one header line per
start: :func:`redirect_rank_output`, called by ``launch.cli.main`` in every rank before anything
else, does that when ``ensure_ranks`` started the ranks (``MEGATRON_GSPO_RANK_LOG_DIR`` set). A
rank that fails still shows on the console: its traceback (or error line) goes to the console's
stderr as well, with the path of its full log. Ranks started by srun keep Slurm's own per-task
output files (``slurm/``), and a process that is not a rank (RANK unset) is never redirected.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

from launch import supervise

RANK_LOG_DIR_ENV = "MEGATRON_GSPO_RANK_LOG_DIR"


def is_launched() -> bool:
    return "WORLD_SIZE" in os.environ or "SLURM_PROCID" in os.environ


def ensure_ranks(subcommand_argv: list[str], world_size: int, *,
                 log_dir: str | os.PathLike) -> Optional[int]:
    if is_launched() or world_size == 1:
        return None
    log_dir = Path(log_dir).resolve()
    # torchrun (launch.torchrun_agent) under a launcher that passes the stop signals on and
    # reports the ranks' outcome once (launch/supervise.py); "--" ends torchrun's own options
    cmd = supervise.torchrun_command(world_size, subcommand_argv)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env[RANK_LOG_DIR_ENV] = str(log_dir)
    print(f"starting {world_size} local ranks: {' '.join(cmd[1:])}", flush=True)
    others = "rank 1 logs" if world_size == 2 else f"ranks 1-{world_size - 1} log"
    print(f"rank 0 prints here; {others} to {log_dir}/rank<N>.log", flush=True)
    return supervise.run_ranks(cmd, env=env, world_size=world_size, log_dir=log_dir,
                               command=subcommand_argv[0] if subcommand_argv else "")


@dataclass
class RankConsole:
    """The console's stderr, kept by a rank whose own output goes to ``log_path``."""

    rank: int
    log_path: Path
    stream: TextIO

    def error(self, line: str) -> None:
        """A one-line failure (configuration or input error) on the console."""
        self.stream.write(f"[rank {self.rank}] {line} (log: {self.log_path})\n")
        self.stream.flush()

    def failure(self, err: BaseException) -> None:
        """An uncaught exception's traceback on the console (it is in the rank's log as well)."""
        text = "".join(traceback.format_exception(err))
        self.stream.write(f"[rank {self.rank}] failed; full log: {self.log_path}\n{text}")
        self.stream.flush()


def redirect_rank_output() -> Optional[RankConsole]:
    """In ranks 1.. started by :func:`ensure_ranks`: send fds 1 and 2 to ``rank<N>.log``.

    Returns the :class:`RankConsole` of such a rank, None everywhere else (rank 0, srun ranks,
    processes that are not ranks). At file-descriptor level, so that what C++ code (gloo, NCCL)
    and child processes print lands in the log too.
    """
    directory, rank = os.environ.get(RANK_LOG_DIR_ENV), os.environ.get("RANK")
    if not directory or rank is None or rank == "0":
        return None
    log_path = Path(directory) / f"rank{rank}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, f"==== {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} (pid {os.getpid()}): "
                 f"{' '.join(sys.argv)}\n".encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # line-buffered from here on: a rank that is killed leaves its last lines in the log
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    return RankConsole(rank=int(rank), log_path=log_path, stream=console)
