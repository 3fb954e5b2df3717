"""How the ranks of a local run tell the launcher how they ended (``launch.supervise``).

The launcher (``megatron-gspo train`` / ``sft`` re-running itself under torchrun) sets
``MEGATRON_GSPO_STATUS_DIR`` to a fresh directory. Every rank it starts writes, as it exits,
``rank<R>.json`` there (:func:`report`, called by ``launch.cli.main``)::

    {"rank": 1, "code": 2, "time": 1733045000.12, "error": "DataError: prompts.jsonl:3: ...",
     "traceback": "Traceback (most recent call last): ...", "log": "RUN_DIR/logs/rank1.log"}

and the torchrun agent (``launch.torchrun_agent``) writes ``torchrun.json`` with the exit codes
it saw when a rank failed. From these the launcher picks the exit status and the ONE message it
prints (:func:`outcome`): a rank killed by a signal other than a stop signal (SIGKILL, a
segfault) first, then the earliest error of any rank (the others are usually its echo: a peer's
gloo error), then a preemption (75: a rank exits 75 only after the collective checkpoint's last
barrier, so one 75 means the checkpoint is complete).

A rank started by anything else (srun, a torchrun of the user's, a single process) has no status
directory and reports nothing: it prints its errors itself.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

STATUS_DIR_ENV = "MEGATRON_GSPO_STATUS_DIR"
PREEMPTED = 75
"""``pipeline.signals.PREEMPTED_EXIT_CODE`` (this module imports no torch)."""


def status_dir() -> Optional[Path]:
    """The launcher's status directory, in a rank it started (RANK set as well); None elsewhere."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if not directory or "RANK" not in os.environ:
        return None
    return Path(directory)


def supervised() -> bool:
    """True in a rank started by ``launch.supervise``: its launcher reports its errors."""
    return status_dir() is not None


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def report(code: int, *, error: Optional[str] = None, traceback: Optional[str] = None,
           log: Optional[str] = None) -> None:
    """In a supervised rank: record how it ends (no-op elsewhere). ``error``: one line."""
    directory = status_dir()
    if directory is None:
        return
    rank = int(os.environ["RANK"])
    try:
        _write_json(directory / f"rank{rank}.json",
                    {"rank": rank, "code": int(code), "time": time.time(), "error": error,
                     "traceback": traceback, "log": log})
    except OSError:
        pass  # the launcher then reports the rank's bare exit status


def report_torchrun(failures: dict[int, dict]) -> None:
    """The torchrun agent: ``{rank: {"exitcode": int, "time": float}}`` of the ranks that failed."""
    directory = os.environ.get(STATUS_DIR_ENV)
    if directory:
        _write_json(Path(directory) / "torchrun.json", {str(k): v for k, v in failures.items()})


@dataclass
class Outcome:
    code: int
    message: Optional[str] = None
    """What the launcher prints (None: nothing to add, e.g. a finished run)."""
    detail: Optional[str] = None
    """The root cause's traceback, shown under the message for crashes (not for input errors)."""


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def outcome(directory: Path, *, world_size: int, agent_code: int, command: str,
            log_dir: Path) -> Outcome:
    """The launcher's exit status and message from the status files of one local run.

    ``agent_code``: the torchrun agent's own exit status, used when no rank said anything;
    ``log_dir``: where ranks 1.. log (named in the messages)."""
    ranks: dict[int, dict] = {}
    for path in directory.glob("rank*.json"):
        try:
            status = json.loads(path.read_text())
            ranks[int(status["rank"])] = status
        except (OSError, ValueError, KeyError):
            continue
    try:
        torchrun = {int(k): v for k, v in json.loads((directory / "torchrun.json").read_text()).items()}
    except (OSError, ValueError):
        torchrun = {}
    prefix = f"megatron-gspo {command}"
    errors = sorted((s for s in ranks.values() if s["code"] not in (0, PREEMPTED)),
                    key=lambda s: s["time"])
    # A rank that died of a signal without a word (SIGKILL, the OOM killer, a segfault) is the
    # root cause: the others' errors are then its echo (a peer's gloo connection closed). Not so
    # for the stop signals: torchrun sends SIGTERM to the ranks still running after the first
    # one ended, and a rank tidying up after its error may die of it before it reports.
    stops = {int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
    killed = sorted(r for r, f in torchrun.items()
                    if r not in ranks and f["exitcode"] < 0 and -f["exitcode"] not in stops)
    if killed:
        rank = killed[0]
        where = f" (its log: {log_dir / f'rank{rank}.log'})" if rank else ""
        return Outcome(1, f"{prefix}: rank {rank} was killed by "
                          f"{_signal_name(torchrun[rank]['exitcode'])}{where}")
    first_error = errors[0] if errors else None
    if first_error is not None:
        where = f" (full log: {first_error['log']})" if first_error.get("log") else ""
        message = first_error.get("error") or f"exited with status {first_error['code']}"
        detail = first_error.get("traceback") if first_error["code"] != 2 else None
        return Outcome(first_error["code"], f"{prefix}: rank {first_error['rank']}: {message}{where}",
                       detail)
    if any(s["code"] == PREEMPTED for s in ranks.values()):
        return Outcome(PREEMPTED, f"{prefix}: stopped after saving a checkpoint; exit "
                                  f"{PREEMPTED} (continue with --resume)")
    if len(ranks) == world_size:
        if agent_code == 0:
            return Outcome(0)
        # every rank finished (0): a stop signal came during the last step, too late to stop
        # it (pipeline.step.step_guard.StepGuard finishes the last step and exports the policy); torchrun,
        # stopped by the signal itself, exits 128 + N. The run is complete: 0, nothing to resume
        return Outcome(0, f"{prefix}: the run finished (the stop signal came during its last "
                          "step); nothing to resume")
    missing = sorted(set(range(world_size)) - set(ranks))
    return Outcome(agent_code or 1, f"{prefix}: ranks {missing} ended without reporting "
                                    f"(torchrun exited with status {agent_code}); see {log_dir}")
