"""One training session on one training rank: what ``train`` and ``sft`` share.

    with Session(cfg, resume=...) as session:    # distributed start, run lock, signals, pid file
        latest = session.checkpoint_to_resume()  # --resume: the newest checkpoint (or None)
        ...                                      # the program's builders and loop

Every resource is registered on ONE ``ExitStack`` the moment it exists - process groups, the run
lock, signal handlers, and whatever the program adds (:attr:`resources`: servers, the metrics
file, update groups) - and leaving the ``with`` releases them in reverse order, on success, error,
Ctrl-C or preemption alike. ``launch.rl_session.RLSession`` (GSPO) and ``launch.sft.SFTSession``
are the two programs built on it.
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from launch import rank_status
from launch.run_lock import hold
from megatron_gspo import parallel
from megatron_gspo.config import Config, ConfigError
from pipeline.signals import StopFlag


class Session:
    """The shared start and stop of a training rank; subclasses add :meth:`run`."""

    def __init__(self, cfg: Config, *, resume: bool):
        self.cfg = cfg
        self.resume = resume
        self.run_dir = Path(cfg.run.output_dir)
        self.control: Optional[dist.ProcessGroup] = None
        """gloo over the whole world: rank 0's broadcasts and the stop flag."""
        self.pg = None
        """Megatron's ProcessGroupCollection of this rank."""
        self.is_main = False
        self.stop = None
        """The stop flag (``pipeline.signals.StopFlag``), installed."""
        self.resources = ExitStack()
        """Released in reverse order when the session ends."""

    def validate(self) -> None:
        """What depends on this machine, checked before anything starts (subclasses)."""

    def __enter__(self) -> "Session":
        try:
            self._start()
        except BaseException:
            self.resources.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.resources.close()

    def _start(self) -> None:
        self.validate()
        self.control = parallel.init_distributed(self.cfg.parallel)
        self.resources.callback(parallel.destroy)  # Megatron's groups, then torch.distributed
        # one run per run dir: rank 0 holds run.lock until the end (every rank fails alike)
        self.resources.enter_context(hold(self.run_dir, group=self.control))
        self.pg = parallel.initialize(self.cfg.parallel, seed=self.cfg.run.seed)
        self.is_main = dist.get_rank() == 0
        if self.is_main:
            layout = parallel.derive_layout(self.cfg.parallel, dist.get_world_size())
            print(f"layout: {layout.describe()}", flush=True)
        self.stop = StopFlag(group=self.control).install()  # checkpoint and exit 75 on a signal
        # a rank under the local launcher exits right after the session and then reports how
        # it ended: a stop signal from here on (the final checkpoint and hf/ written) must not
        # kill it first ("ranks [0] ended without reporting", exit 143: bench/stop_trials.py)
        self.resources.callback(self.stop.uninstall, exiting=rank_status.supervised())
        write_pid_file(self.run_dir)

    def checkpoint_to_resume(self) -> Optional[Path]:
        """``--resume``: the newest checkpoint of ``run.output_dir`` (None: there is none, said
        on rank 0, the run starts at step 0). Without ``--resume`` a run directory that holds
        checkpoints is refused (nothing is overwritten)."""
        from megatron_gspo.train.checkpoint import checkpoint_root, latest_checkpoint

        latest = latest_checkpoint(self.run_dir) if self.resume else None
        if self.resume and latest is None and self.is_main:
            print(f"--resume: no checkpoint in {checkpoint_root(self.run_dir)}, starting at step 0",
                  flush=True)
        if not self.resume and checkpoint_root(self.run_dir).joinpath("latest").exists():
            raise ConfigError(f"run.output_dir: {self.run_dir} already holds checkpoints; pass "
                              "--resume to continue that run or choose another run.output_dir")
        return latest

    def say_resumed(self, latest: Path, step: int) -> None:
        if self.is_main:
            print(f"resumed from {latest} (step {step})", flush=True)


def write_pid_file(run_dir: Path) -> None:
    """<run_dir>/pids/rank<R>.pid: which process is which training rank (for operators, tests)."""
    pid_dir = run_dir / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
