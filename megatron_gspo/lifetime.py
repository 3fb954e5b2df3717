"""Child processes that cannot outlive the process that started them.

A training rank killed with SIGKILL runs no cleanup: the rollout servers it started and the
worker processes of Megatron's checkpoint writer would live on (holding ports, memory and the
parent's stdout). ``die_with_parent`` (for ``preexec_fn`` / process initialisers) asks Linux to
deliver SIGKILL to the child when its parent dies (``prctl(PR_SET_PDEATHSIG)``); elsewhere it does
nothing.
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
