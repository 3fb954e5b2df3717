"""torchrun as a local run's launcher needs it: ``python -m launch.torchrun_agent <torchrun args>``.

``launch.supervise`` starts the ranks of ``megatron-gspo train`` / ``sft`` with this module instead
of ``python -m torch.distributed.run``. It is torchrun (its own argument parser, rendezvous and
agent), with four changes:

* **Stores on the job's address.** torchrun's stores listen on the address they are for instead
  of every interface (``megatron_gspo.bound_store``): the c10d rendezvous store on the host of
  ``--rdzv-endpoint`` (``--standalone``: localhost, 127.0.0.1), the store it shares with the
  ranks (their ``MASTER_ADDR``/``MASTER_PORT``; they connect as clients) on ``--local-addr``
  (127.0.0.1 for a local run: ``launch.supervise``).
* **One stop per run.** torchrun turns a signal into an exception that makes it stop the ranks
  (the same signal to each rank's process group, SIGKILL after ``--shutdown-timeout``). A second
  signal during that stop (the launcher forwards a signal that a ``killpg`` also delivered
  directly; a user presses Ctrl-C twice) would raise again inside the stop and leave the ranks,
  which are in sessions of their own, running without anyone waiting for them. Here only the
  first signal counts; later ones are logged once torchrun has returned (a signal handler that
  logs can re-enter the log file's writer). SIGHUP and SIGQUIT reach the ranks as SIGTERM, the
  signal they checkpoint on (``pipeline.signals.StopFlag``).
* **Quiet.** torchrun's log (its warnings, and when a rank fails the ``ChildFailedError`` report
  with every rank's traceback) goes to ``<log dir>/torchrun.log``; the launcher prints the one
  root cause (``launch.rank_status``).
* **What it saw.** The ranks that failed, with their exit codes, go to the status directory
  (``torchrun.json``), so that the launcher can name a rank killed by a signal.

The exit status is torchrun's (0, or 1 when a rank failed; 128 + N after signal N); the launcher
decides the command's own from the ranks' reports.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Optional

from launch import rank_status
from megatron_gspo.bound_store import tcp_store

LOG_DIR_ENV = "MEGATRON_GSPO_RANK_LOG_DIR"
"""Set by ``launch.local.ensure_ranks`` (where the ranks log); torchrun.log goes there too."""


def _log_to_file(log_dir: Optional[str]) -> None:
    """Every log record of this process to ``<log_dir>/torchrun.log`` (nowhere without a dir).

    torch gives its ``torch`` and ``torch.distributed`` loggers console handlers of their own
    (``torch._logging``, propagate off): those are replaced as well."""
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        handler: logging.Handler = logging.FileHandler(Path(log_dir) / "torchrun.log")
    else:
        handler = logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.captureWarnings(True)
    for name in ("torch", "torch.distributed"):
        logger = logging.getLogger(name)
        if logger.handlers:
            logger.handlers = [handler]


def _stop_once(mp_api) -> list[int]:
    """Replace torchrun's signal handler with one that raises for the first signal only. Returns
    the list the handler appends every signal to, in order: :func:`_log_signals` logs it once
    torchrun has returned. The handler itself does no I/O: a second signal that arrives while the
    first one's handler writes a log line re-enters the log file's writer ("reentrant call
    inside <_io.BufferedWriter>", which logging prints with a traceback)."""
    original = mp_api._terminate_process_handler
    seen: list[int] = []

    def handler(signum: int, frame) -> None:
        seen.append(signum)
        if len(seen) > 1:
            return  # the ranks are already stopping
        if signum not in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM):
            signum = signal.SIGTERM  # SIGHUP / SIGQUIT: the ranks checkpoint on SIGTERM
        original(signum, frame)

    # PContext.start looks the handler up by name when it registers it (after this runs)
    mp_api._terminate_process_handler = handler
    return seen


def _log_signals(log: logging.Logger, seen: list[int]) -> None:
    """The signals :func:`_stop_once`'s handler received: the first stopped the ranks, the
    others came during that stop and were not acted on."""
    if not seen:
        return
    first = signal.Signals(seen[0]).name
    log.warning("signal %s: stopped the ranks", first)
    for signum in seen[1:]:
        log.warning("signal %s during the stop that %s started: the ranks were already "
                    "stopping (SIGKILL aborts)", signal.Signals(signum).name, first)


def _bind_stores() -> None:
    """torchrun's master stores listen on the host they are given only (torch's would listen on
    every interface): the rendezvous backend's store (``--rdzv-endpoint``; "localhost" is
    127.0.0.1) and the shared store of the ranks (``--local-addr``)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    def rendezvous_store(host_name, port, world_size=None, is_master=False,
                         timeout=datetime.timedelta(seconds=300), wait_for_workers=True,
                         multi_tenant=False, **_):
        try:
            return tcp_store(host_name, port, is_master=is_master, world_size=world_size,
                             timeout=timeout, wait_for_workers=wait_for_workers,
                             multi_tenant=multi_tenant)
        except OSError as err:  # what torch's own raises: the backend then tries as a client
            raise RuntimeError(str(err)) from err

    def shared_store_server(self, master_addr, master_port):
        return tcp_store(master_addr, master_port, is_master=True, multi_tenant=True)

    c10d_rendezvous_backend.TCPStore = rendezvous_store
    dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server = shared_store_server


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from torch.distributed.elastic.multiprocessing import api as mp_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _log_to_file(os.environ.get(LOG_DIR_ENV))
    signals = _stop_once(mp_api)
    _bind_stores()
    log = logging.getLogger("launch.torchrun_agent")
    try:
        run(parse_args(argv))
        return 0
    except ChildFailedError as err:
        log.error("%s", err.format_msg())
        rank_status.report_torchrun({rank: {"exitcode": failure.exitcode,
                                            "time": float(failure.timestamp)}
                                     for rank, failure in err.failures.items()})
        return 1
    except mp_api.SignalException as err:
        log.warning("stopped by %s", err.sigval.name)
        return 128 + int(err.sigval)
    finally:
        _log_signals(log, list(signals))


if __name__ == "__main__":
    sys.exit(main())
