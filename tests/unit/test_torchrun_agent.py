"""``launch.torchrun_agent``'s stop: the first signal stops the ranks, later ones are not acted
on, and the signal handler does no I/O (a second signal that arrived while the first one's
handler wrote its log line re-entered the log file's writer: logging printed "reentrant call
inside <_io.BufferedWriter>" with a traceback into the launcher's output; seen in the extended
tier's test_signals). The signals are logged once torchrun has returned."""

from __future__ import annotations

import logging
import signal
from types import SimpleNamespace

import pytest

from launch import torchrun_agent


class Stop(Exception):
    pass


def install():
    calls = []

    def original(signum, frame):
        calls.append(signum)
        raise Stop(signum)

    mp_api = SimpleNamespace(_terminate_process_handler=original)
    seen = torchrun_agent._stop_once(mp_api)
    return mp_api._terminate_process_handler, seen, calls


def test_the_first_signal_stops_the_ranks_and_later_ones_do_nothing(caplog):
    handler, seen, calls = install()
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(Stop):
            handler(signal.SIGHUP, None)  # the ranks checkpoint on SIGTERM
        assert handler(signal.SIGTERM, None) is None
        assert handler(signal.SIGINT, None) is None
    assert calls == [signal.SIGTERM]
    assert seen == [signal.SIGHUP, signal.SIGTERM, signal.SIGINT]
    assert caplog.records == []  # no I/O inside a signal handler

    log = logging.getLogger("test_torchrun_agent")
    with caplog.at_level(logging.WARNING, logger="test_torchrun_agent"):
        torchrun_agent._log_signals(log, seen)
    assert [r.getMessage() for r in caplog.records] == [
        "signal SIGHUP: stopped the ranks",
        "signal SIGTERM during the stop that SIGHUP started: the ranks were already stopping "
        "(SIGKILL aborts)",
        "signal SIGINT during the stop that SIGHUP started: the ranks were already stopping "
        "(SIGKILL aborts)"]
