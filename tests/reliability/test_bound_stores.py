"""Issue 11, item 10: the trainer's stores listen on the job's address, not on every interface.

torch's ``TCPStore`` listens on ``::`` / ``0.0.0.0`` whatever host it is given. Before the fix a
local ``megatron-gspo train`` had three such listeners: torchrun's c10d rendezvous store, the
store torchrun shares with the ranks, and (under srun, no torchrun) rank 0's ``env://`` store.
:func:`check_no_wildcard_listener` reads every listening TCP socket of every process of a running
local train (launcher, torchrun, ranks, the rollout server, the router, Megatron's writer helper)
from ``/proc``: none may listen on a wildcard address, and the stores listen on 127.0.0.1. It runs
inside tests/reliability/test_signals.py's first start (a 2-rank train that is running anyway).
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

import pytest

from megatron_gspo.bound_store import resolve, tcp_store

WILDCARDS = {"0.0.0.0", "::", "::ffff:0.0.0.0"}


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # 4 little-endian words
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listeners(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes ``pids`` hold."""
    by_inode: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                by_inode[fields[9]] = _address(fields[1])
    found = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in by_inode:
                found.append((pid, *by_inode[target[8:-1]]))
    return found


def test_master_store_listens_on_its_host_only():
    store = tcp_store("localhost", 0, is_master=True, world_size=1,
                      timeout=datetime.timedelta(seconds=30))
    store.set("key", "value")
    client = tcp_store("127.0.0.1", store.port, is_master=False, world_size=1,
                       timeout=datetime.timedelta(seconds=30))
    assert client.get("key") == b"value"
    mine = listeners([os.getpid()])
    assert ("127.0.0.1", store.port) in [(a, p) for _, a, p in mine], mine
    assert not [entry for entry in mine if entry[1] in WILDCARDS], mine
    with pytest.raises(OSError, match=r"cannot resolve the store address 'no-such-host\.invalid'"):
        resolve("no-such-host.invalid")


def check_no_wildcard_listener(pids: list[int]) -> None:
    """Every listening TCP socket of ``pids`` (the processes of a running local train) is bound
    to a specific address, and torchrun's two stores listen on 127.0.0.1. Called by
    tests/reliability/test_signals.py while its 2-rank train runs (one start serves both)."""
    found = listeners(pids)
    agents = [pid for pid in pids
              if b"launch.torchrun_agent" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    wild = [entry for entry in found if entry[1] in WILDCARDS]
    assert not wild, f"listening on every interface (pid, address, port): {wild}\nall: {found}"
    # torchrun's rendezvous store and the store it shares with the ranks, on 127.0.0.1
    assert len(agents) == 1 and len([e for e in found if e[0] == agents[0]
                                     and e[1] == "127.0.0.1"]) >= 2, (agents, found)
