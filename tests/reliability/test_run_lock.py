"""Issue 11, item 3: one run per run directory (``launch.run_lock``).

Two runs on one ``run.output_dir`` used to both start (one crashed inside the other's checkpoint,
the metrics interleaved). The lock refuses the second, naming the first (host, pid, start time,
command); it goes with its holder however that ends (the kernel drops the flock of a SIGKILLed
process), and a stale record is taken over with a message: a dead pid on this host, or a holder
on another host whose heartbeat stopped. The end-to-end case (a second ``train`` while one runs)
is in test_signals.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.run_lock import STALE_AFTER_S, RunDirLocked, RunLock, check_free, lock_path
from tests.reliability.conftest import ROOT

HOLDER = r'''
import sys, time
from launch.run_lock import RunLock
lock = RunLock(sys.argv[1], command="megatron-gspo train --config first.yaml").acquire()
print("held", flush=True)
if sys.argv[2] == "hold":
    time.sleep(600)
lock.release()
'''


def start_holder(run_dir: Path, mode: str = "hold") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), mode], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_is_refused_naming_the_first(tmp_path):
    holder = start_holder(tmp_path)
    try:
        for attempt in (lambda: RunLock(tmp_path).acquire(), lambda: check_free(tmp_path)):
            with pytest.raises(RunDirLocked) as refused:
                attempt()
            message = str(refused.value)
            assert f"run.output_dir: {tmp_path} is in use by another run" in message
            assert f"pid {holder.pid} on host {socket.gethostname()}, started " in message
            assert "megatron-gspo train --config first.yaml" in message
            assert time.strftime("%Y-%m-%d") in message
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_goes_with_its_holder_even_on_sigkill(tmp_path):
    holder = start_holder(tmp_path)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    check_free(tmp_path)  # the dead holder's record is stale: no refusal
    lock = RunLock(tmp_path).acquire()
    try:
        assert lock.took_over and f"pid {holder.pid} on host {socket.gethostname()}" in lock.took_over
        record = json.loads(lock_path(tmp_path).read_text())
        assert record["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_released_lock_is_free_and_says_nothing(tmp_path):
    holder = start_holder(tmp_path, mode="release")
    holder.wait()
    assert lock_path(tmp_path).read_text() == ""
    lock = RunLock(tmp_path).acquire()
    assert lock.took_over is None
    lock.release()


def test_another_hosts_lock_is_stale_once_its_heartbeat_stops(tmp_path):
    path = lock_path(tmp_path)
    path.write_text(json.dumps({"host": "ghost-node-7", "pid": 4242, "started": time.time() - 3600,
                                "command": "megatron-gspo train ..."}))
    # fresh heartbeat: a live run elsewhere (flock may be local to each host): refused
    with pytest.raises(RunDirLocked, match="pid 4242 on host ghost-node-7"):
        RunLock(tmp_path).acquire(wait_for_stale_s=0.5)
    with pytest.raises(RunDirLocked, match="ghost-node-7"):
        check_free(tmp_path)
    # its heartbeat stopped long ago: taken over
    old = time.time() - STALE_AFTER_S - 60
    os.utime(path, (old, old))
    check_free(tmp_path)
    lock = RunLock(tmp_path).acquire(wait_for_stale_s=0.5)
    try:
        assert "ghost-node-7" in lock.took_over
    finally:
        lock.release()


def test_a_reused_pid_does_not_keep_a_stale_lock(tmp_path):
    """Same host, the recorded pid alive but another process (its start time differs)."""
    lock_path(tmp_path).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                               "pid_start": 1, "started": time.time()}))
    check_free(tmp_path)
    lock = RunLock(tmp_path).acquire()
    lock.release()
