"""One run per run directory: ``<run.output_dir>/run.lock``, held by rank 0 while it trains.

Two runs on one ``run.output_dir`` write the same checkpoints and metrics (one crashes inside the
other's checkpoint, the metrics interleave). ``train`` and ``sft`` therefore take this lock on
rank 0 for the whole run (:func:`hold`, collective: every rank fails alike when it is taken), and
the launchers look at it before they start anything (:func:`check_free`, ``launch.preflight``).
A refusal names the other run: host, pid, start time, command (and Slurm job).

The lock is a kernel ``flock`` on the file (released by the kernel on ANY exit of the holder,
SIGKILL included) plus its contents, JSON naming the holder, rewritten every
:data:`HEARTBEAT_S` seconds. Stale locks:

* same host: a holder whose process is gone (or is another process with a reused pid: the
  process start time is part of the record) is stale; the flock says so too;
* another host (a shared filesystem, where flock may be local to each host): a holder that has
  not written its heartbeat for :data:`STALE_AFTER_S` seconds is stale (its host died or lost
  the filesystem). A live one on another host is refused after waiting up to that long for it to
  go stale (a requeued job may start before its predecessor's host noticed it is gone).

A stale lock is taken over with a message saying whose it was. Releasing empties the file
(the file stays: unlinking it under a waiting opener would let two runs lock two files).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_gspo.errors import InputError

LOCK_NAME = "run.lock"
HEARTBEAT_S = 15.0
STALE_AFTER_S = 120.0


class RunDirLocked(RuntimeError, InputError):
    """``run.output_dir`` is in use by another live run (the message names it), or its lock file
    cannot be used at all (a directory in its place, an unwritable run directory: the message
    names the path)."""


def _unusable(path: Path) -> Optional[str]:
    """Why ``path`` cannot be a lock file (something other than a regular file is there)."""
    if path.is_dir():
        return (f"run.output_dir: the lock file {path} is a directory; remove it (or choose "
                "another run.output_dir)")
    if path.exists() and not path.is_file():
        return (f"run.output_dir: the lock file {path} is not a regular file; remove it (or "
                "choose another run.output_dir)")
    return None


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LOCK_NAME


def _process_start(pid: int) -> Optional[int]:
    """The start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    job = f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started {when}"
            f"{job}: {holder.get('command', '?')}")


def _read(path: Path) -> Optional[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError:
        return None
    if not text.strip():
        return None  # released (or never written)
    try:
        holder = json.loads(text)
    except ValueError:
        return {"host": "?", "pid": "?", "command": f"(unreadable lock file {path})"}
    return holder if isinstance(holder, dict) else None


def _alive(holder: dict[str, Any], path: Path, *, flock_free: Optional[bool]) -> bool:
    """Whether the run ``holder`` names still runs (see the module docstring)."""
    if holder.get("host") == socket.gethostname():
        if flock_free:
            return False  # the kernel released its lock: it exited
        pid = holder.get("pid")
        return (isinstance(pid, int) and _process_start(pid) is not None
                and _process_start(pid) == holder.get("pid_start"))
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return False
    return age < STALE_AFTER_S


def check_free(run_dir: str | Path) -> None:
    """Raise :class:`RunDirLocked` if a live run holds ``run_dir``'s lock (takes nothing)."""
    path = lock_path(run_dir)
    problem = _unusable(path)
    if problem:
        raise RunDirLocked(problem)
    holder = _read(path)
    if holder is None:
        return
    flock_free = None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        flock_free = True
    except OSError as err:
        flock_free = False if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    finally:
        os.close(fd)
    if _alive(holder, path, flock_free=flock_free):
        raise RunDirLocked(_refusal(run_dir, holder))


def _refusal(run_dir: str | Path, holder: dict[str, Any]) -> str:
    return (f"run.output_dir: {run_dir} is in use by another run ({_describe(holder)}); stop it, "
            "wait for it to finish, or choose another run.output_dir")


class RunLock:
    """The lock of one run directory, held by this process (see the module docstring)."""

    def __init__(self, run_dir: str | Path, *, command: Optional[str] = None):
        self.run_dir = Path(run_dir)
        self.path = lock_path(run_dir)
        self.command = command or " ".join(sys.argv)
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.took_over: Optional[str] = None
        """The description of the stale holder this lock replaced, if any."""

    def _record(self) -> bytes:
        return json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "pid_start": _process_start(os.getpid()), "started": time.time(),
                           "command": self.command,
                           "slurm_job": os.environ.get("SLURM_JOB_ID")}).encode()

    def acquire(self, *, wait_for_stale_s: float = STALE_AFTER_S) -> "RunLock":
        problem = _unusable(self.path)
        if problem:
            raise RunDirLocked(problem)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirLocked(f"run.output_dir: cannot create the lock file {self.path}: "
                               f"{err.strerror or err}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                flock_free: Optional[bool] = True
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    flock_free = None  # no flock on this filesystem: the record decides
                else:  # a live holder (the kernel says so); its record may be a moment late
                    holder = _read(self.path)
                    for _ in range(10):
                        if holder is not None:
                            break
                        time.sleep(0.1)
                        holder = _read(self.path)
                    raise RunDirLocked(_refusal(self.run_dir, holder or {})) from None
            holder = _read(self.path)
            deadline = time.monotonic() + wait_for_stale_s
            if holder is not None and holder.get("host") != socket.gethostname() and \
                    _alive(holder, self.path, flock_free=flock_free):
                print(f"run.output_dir: {self.run_dir} is locked by {_describe(holder)}; waiting "
                      f"up to {wait_for_stale_s:.0f} s for it to go stale (no heartbeat)",
                      file=sys.stderr, flush=True)
            while holder is not None and _alive(holder, self.path, flock_free=flock_free):
                # only a holder on another host gets here with the flock ours: wait for its
                # heartbeat to stop (a requeued job's predecessor), refuse if it goes on
                if holder.get("host") == socket.gethostname() or time.monotonic() > deadline:
                    raise RunDirLocked(_refusal(self.run_dir, holder))
                time.sleep(min(HEARTBEAT_S, 5.0))
                holder = _read(self.path)
            if holder is not None:
                self.took_over = _describe(holder)
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._record(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


@contextmanager
def hold(run_dir: str | Path, *, group=None) -> Iterator[Optional[RunLock]]:
    """Collective over ``group``: rank 0 takes ``run_dir``'s lock for the ``with`` block; every
    rank raises :class:`RunDirLocked` (the same message) when another live run holds it."""
    # torch only here: the launcher's preflight (check_free) imports this module without torch
    from megatron_gspo.collectives import on_rank0

    lock = None

    def take() -> None:  # rank 0
        nonlocal lock
        lock = RunLock(run_dir).acquire()
        if lock.took_over:
            print(f"run.output_dir: took over the stale lock of {lock.took_over}", flush=True)
    on_rank0(take, group=group)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
