"""The launcher of a local multi-rank run: torchrun under it, every stop signal passed on, one exit status.

``megatron-gspo train`` / ``sft`` with more than one rank and no torchrun / srun around them re-run
themselves under torchrun (``launch.local.ensure_ranks``); :func:`run_ranks` is that re-run::

    launcher (this process)                      signals: SIGTERM SIGINT SIGUSR1 SIGHUP -> torchrun
      `- python -m launch.torchrun_agent ...     own session; SIGTERM when the launcher dies
           `- rank 0 .. N-1 (python -m launch.cli ...)   own sessions (torchrun's); they save a
                                                 checkpoint on the signal and exit 75

* **Signals.** The launcher passes SIGTERM, SIGINT and SIGUSR1 on to torchrun (SIGHUP as
  SIGTERM) and waits for it; torchrun sends the signal to every rank's process group and waits
  (``--shutdown-timeout``, :data:`SHUTDOWN_TIMEOUT_S` unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT is
  set) while they finish their step and write the checkpoint (``pipeline.step.step_guard.StepGuard``).
  torchrun has a session of its own, so a Ctrl-C reaches it once, through the launcher; a
  ``killpg`` of torchrun's group, or of the launcher's, works the same way. A second SIGTERM,
  SIGINT or SIGHUP (a second Ctrl-C, a second ``kill``; one second or more after the first)
  does not wait for the checkpoint: the launcher SIGKILLs torchrun, the ranks and everything
  below them (:func:`kill_tree`) and exits 128 + N. If the launcher dies
  (even by SIGKILL), torchrun gets SIGTERM (PR_SET_PDEATHSIG), and the ranks get SIGTERM when
  torchrun dies: nothing trains on in the background.
* **One exit status, one message.** Every rank reports how it ended (``launch.rank_status``);
  the launcher exits with 75 after a preemption (every rank saved), 2 for an input error (the
  file, the data, the reward: the first rank's message, printed once), 1 for a crash (the first
  failing rank's traceback, printed once; the others, usually a peer's gloo error, stay in their
  logs), 0 for a finished run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch import rank_status
from megatron_gspo.lifetime import die_with_parent

FORWARDED = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT,
             signal.SIGUSR1: signal.SIGUSR1, signal.SIGHUP: signal.SIGTERM}
"""Signal the launcher receives -> signal it sends torchrun."""

SHUTDOWN_TIMEOUT_S = 900
"""How long torchrun waits for the ranks to finish their step and checkpoint after a stop signal
before it kills them (SIGKILL): a GSPO step of a large model takes minutes."""


HARD_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""A second one of these (after a first, :data:`REPEAT_MIN_S` or more before) kills the run."""

REPEAT_MIN_S = 1.0
"""A stop signal this soon after the first is the same stop delivered twice (a ``killpg`` that
reached the launcher and a terminal's), not a second request."""


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... (Linux: /proc/<pid>/task/*/children), parents
    first; [] where /proc has no such file."""
    out, todo = [], [pid]
    while todo:
        parent = todo.pop(0)
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += [k for k in kids if k not in out]
            todo += kids
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it (in any session). Stopped first (SIGSTOP),
    so that none reacts to another's death (a rank's parent-death SIGTERM, a restart) while the
    tree is collected."""
    seen: list[int] = []
    for _ in range(3):  # what was started while the tree was being collected
        found = [p for p in [pid, *descendants(pid)] if p not in seen]
        if not found:
            break
        for p in found:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        seen += found
    for p in seen:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def torchrun_command(world_size: int, script_argv: list[str]) -> list[str]:
    """The command line of the torchrun agent that starts ``world_size`` local ranks of
    ``python -m launch.cli <script_argv>``.

    The ``--`` ends torchrun's own options: without it torchrun's argparse also reads the
    command's options and rejects or takes them (``--nproc`` is an ambiguous prefix of
    ``--nproc-per-node``). torchrun drops the ``--``; launch.cli.main drops it too where an
    argparse version keeps it."""
    timeout = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))
    return [sys.executable, "-m", "launch.torchrun_agent", "--standalone",
            "--local-addr=127.0.0.1",  # the ranks' MASTER_ADDR; the agent's stores listen there
            f"--nproc-per-node={world_size}",
            "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1,SIGHUP,SIGQUIT",
            f"--shutdown-timeout={timeout}", "-m", "launch.cli", "--", *script_argv]


def _torchrun_preexec() -> None:
    die_with_parent(signal.SIGTERM)  # the launcher gone: stop the ranks as on a signal


def run_ranks(cmd: list[str], *, env: dict, world_size: int, log_dir: Path, command: str) -> int:
    """Run ``cmd`` (:func:`torchrun_command`) in its own session, pass the stop signals on, wait;
    returns the command's exit status and prints its one message (see the module docstring)."""
    status_dir = Path(tempfile.mkdtemp(prefix="megatron-gspo-status-"))
    env = dict(env, **{rank_status.STATUS_DIR_ENV: str(status_dir)})
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_torchrun_preexec)

    first_stop: list[float] = []
    killed_by: list[int] = []

    def forward(signum, frame) -> None:
        if signum in HARD_STOP_SIGNALS and first_stop and not killed_by \
                and time.monotonic() - first_stop[0] >= REPEAT_MIN_S:
            killed_by.append(signum)  # the second stop: no more waiting for a checkpoint
            print(f"megatron-gspo {command}: second stop signal ({signal.Signals(signum).name}): "
                  "killing every process of the run (SIGKILL)", file=sys.stderr, flush=True)
            kill_tree(proc.pid)
            return
        if signum in HARD_STOP_SIGNALS and not first_stop:
            first_stop.append(time.monotonic())
        try:
            proc.send_signal(FORWARDED[signum])
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        agent_code = proc.wait()  # a handled signal interrupts nothing here (PEP 475)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:  # an exception in this process: the ranks must not go on
            proc.send_signal(signal.SIGTERM)
            proc.wait()
    if killed_by:
        shutil.rmtree(status_dir, ignore_errors=True)
        print(f"megatron-gspo {command}: killed on a second stop signal: the step in progress "
              "was not saved (--resume continues from the last checkpoint)", file=sys.stderr,
              flush=True)
        return 128 + killed_by[0]
    try:
        result = rank_status.outcome(status_dir, world_size=world_size, agent_code=agent_code,
                                     command=command, log_dir=log_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)
    if result.message:
        print(result.message, file=sys.stderr, flush=True)
    if result.detail:
        print(result.detail.rstrip(), file=sys.stderr, flush=True)
    return result.code
