"""Stop signals: a training rank finishes its step, checkpoints and exits "requeue me".

Every training rank installs a :class:`StopFlag`; :class:`pipeline.step.step_guard.StepGuard` decides
at each point of a step what a signal means there (which checkpoint, then stop).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM / SIGINT / SIGUSR1 after saving a checkpoint (EX_TEMPFAIL):
"requeue me". A finished run exits 0, a failed one with another non-zero status."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""The signals a training rank checkpoints and stops on (:class:`StopFlag`)."""


@dataclass
class StopFlag:
    """Set by SIGTERM / SIGINT / SIGUSR1: finish the current step, save, exit with
    PREEMPTED_EXIT_CODE. SIGINT (Ctrl-C; what torchrun passes on from the launcher) counts as a
    stop request too: the checkpoint is written first. A second signal changes nothing (the stop
    is under way; SIGKILL aborts it)."""

    signum: Optional[int] = None
    group: Any = None
    """The group of the all-reduce: the host-side control group (gloo); None: the default."""
    _previous: dict = field(default_factory=dict)
    _stopping: bool = False
    """Some rank was signalled (``any_rank``): this one is stopping too."""

    def install(self) -> "StopFlag":
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self, *, exiting: bool = False) -> None:
        """Give the stop signals back to the handlers ``install`` replaced - unless a stop was
        requested: that process is on its way out with its checkpoint written, and the signals
        stay ignored, so that a late one (torchrun stops the ranks that are still tidying up
        once the first has exited) cannot kill it before it exits with PREEMPTED_EXIT_CODE.
        ``exiting``: the process exits after this (a rank whose launcher waits for its report):
        the signals stay ignored whatever happened, so that a stop signal in the last moments of
        a finished run cannot kill it before it reports (the launcher exited 143)."""
        stopping = self.signum is not None or self._stopping or exiting
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, signal.SIG_IGN if stopping else handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is None:  # the first one names the stop
            self.signum = signum

    def any_rank(self) -> bool:
        """True on every rank if any rank was signalled (one tiny all-reduce)."""
        flag = torch.tensor([1.0 if self.signum is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self._stopping = self._stopping or bool(flag.item())
        return bool(flag.item())
