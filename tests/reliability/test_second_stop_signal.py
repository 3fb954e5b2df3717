"""Issue 22, item 1: a stop signal ends a local run in bounded time, whatever its processes do.

The first SIGTERM / SIGINT to the launcher (``launch.supervise.run_ranks``) is passed on to
torchrun, which waits for the ranks' checkpoint. A second one (a second Ctrl-C) does not wait:
the launcher SIGKILLs torchrun and every process below it, in whatever session, and exits
128 + N. Here "torchrun" is a stand-in that ignores SIGTERM and starts a child in a session of
its own that ignores it too (what a rank stuck in user code looks like to the launcher).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_second_stop_signal_kills_every_process_below_the_launcher(tmp_path):
    pids = tmp_path / "pids"
    stubborn = textwrap.dedent(f'''
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"],
                                 start_new_session=True)
        import os
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(3600)
    ''')
    launcher = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f'''
        import sys
        from pathlib import Path
        from launch import supervise
        sys.exit(supervise.run_ranks([sys.executable, "-c", {stubborn!r}], env=dict(__import__("os").environ),
                                     world_size=2, log_dir=Path({str(tmp_path)!r}), command="train"))
    ''')], cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        agent, child = map(int, pids.read_text().split())
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1.5)
        assert launcher.poll() is None and _alive(agent)  # the first one is waited out
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=30)
        stderr = launcher.stderr.read()
        deadline = time.monotonic() + 10
        while (_alive(agent) or _alive(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(agent) and not _alive(child), (agent, child)
        assert code == 128 + signal.SIGTERM, stderr
        assert "second stop signal (SIGTERM): killing every process of the run" in stderr
        assert "the step in progress was not saved" in stderr
    finally:
        launcher.kill()
        for pid in (map(int, pids.read_text().split()) if pids.exists() else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


LATE_SIGNAL = r'''
import os, signal, sys
from pipeline.signals import StopFlag

stop = StopFlag().install()
stop.uninstall(exiting=sys.argv[1] == "exiting")
os.kill(os.getpid(), signal.SIGTERM)  # after the session, before the rank reports
print("reported", flush=True)
'''


@pytest.mark.parametrize("exiting", [True, False])
def test_a_stop_signal_after_a_ranks_session_ended_does_not_kill_it_before_it_reports(exiting):
    """bench/stop_trials.py (issue 38's acceptance check), SIGTERM 0.26 s into the final save
    of a 3-step run: it reached rank 0 after its session had given the stop signals back
    (everything written) and before it reported; the rank died of it and the launcher exited
    143 ("ranks [0] ended without reporting") for a finished run. A supervised rank's session
    now leaves them ignored (``launch.session.Session``); a session in a process that goes on
    restores the previous handlers."""
    done = subprocess.run([sys.executable, "-c", LATE_SIGNAL, "exiting" if exiting else "-"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    if exiting:
        assert done.returncode == 0 and done.stdout == "reported\n", done.stderr[-2000:]
    else:
        assert done.returncode == -signal.SIGTERM and done.stdout == ""
