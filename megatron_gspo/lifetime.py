"""Child processes that cannot outlive the process that started them, and helpers that outlive a stop signal.

A training rank killed with SIGKILL runs no cleanup: the rollout servers it started and the
worker processes of Megatron's checkpoint writer would live on (holding ports, memory and the
parent's stdout). ``die_with_parent`` (for ``preexec_fn`` / process initialisers) asks Linux to
deliver a signal (SIGKILL by default) to the child when its parent dies
(``prctl(PR_SET_PDEATHSIG)``); elsewhere it does nothing.

PR_SET_PDEATHSIG fires when the THREAD that started the child ends, not its process: a helper
started from a thread that ends (a rollout's thread, one per step under ``rollout.async:
one_step``) is killed with it. ``on_a_lasting_thread`` runs the start on the main thread or on one
daemon thread kept for the purpose.

The opposite danger: a stop signal that reaches EVERY process of a job at once (torchrun's
``killpg`` of a rank's process group, Slurm's ``scancel`` / requeue / preemption, systemd's stop of
a cgroup) would kill a rank's helpers - the checkpoint writer's queue server, the rollout servers
and the router - while the rank itself, which catches the signal, still needs them to write its
preemption checkpoint. ``shield_from_stop_signals`` (in the helper, before it starts work)
blocks ``STOP_SIGNALS`` there; the owner stops the helper explicitly afterwards (SIGKILL, or a
shutdown request), and ``die_with_parent`` still ends it if the owner dies first.
"""

from __future__ import annotations

import ctypes
import queue
import signal
import sys
import threading
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

PR_SET_PDEATHSIG = 1

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
"""What a launcher, a scheduler or a terminal sends to ask a job to stop."""


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig))
    except OSError:
        pass


def shield_from_stop_signals() -> None:
    """Block the stop signals in this process (and what it starts or execs from here on).

    A blocked signal stays pending, whatever handler the program installs later (uvicorn, the
    router's runtime): only SIGKILL, or the owner's own request, ends a shielded helper."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def shielded_helper() -> None:
    """``preexec_fn`` / initializer of a rank's helper process: dies with its owner (SIGKILL) and
    survives the stop signals that reach the whole job."""
    die_with_parent()
    shield_from_stop_signals()


_starts: "queue.SimpleQueue" = queue.SimpleQueue()
_starter: Optional[threading.Thread] = None
_starter_lock = threading.Lock()


def on_a_lasting_thread(fn: Callable[[], T]) -> T:
    """``fn()`` (which starts child processes that die with this one) on a thread that lives as
    long as this process: the caller's if it is the main thread, else one daemon thread kept for
    the purpose (the children's PR_SET_PDEATHSIG then fires with the process, not with the
    caller's thread). Its value, or its error raised here."""
    global _starter
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _starter_lock:
        if _starter is None:
            def serve() -> None:
                while True:
                    call, answer = _starts.get()
                    try:
                        answer.put((True, call()))
                    except BaseException as err:  # noqa: BLE001 - raised in the caller
                        answer.put((False, err))
            _starter = threading.Thread(target=serve, name="helper-starter", daemon=True)
            _starter.start()
    answer: "queue.SimpleQueue" = queue.SimpleQueue()
    _starts.put((fn, answer))
    ok, value = answer.get()
    if not ok:
        raise value
    return value
