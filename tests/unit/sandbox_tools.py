"""Tools for the sandbox tests (registered as "tests.unit.sandbox_tools:NAME")."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time


def add(a: int, b: int) -> int:
    return a + b


def shout(text: str) -> str:
    print("printed:", text)
    return text.upper()


def hang(seconds: float = 3600.0) -> str:
    time.sleep(seconds)
    return "woke up"


def spin() -> None:
    while True:  # a busy loop holding the GIL
        pass


def allocate(mb: int) -> int:
    block = bytearray(mb << 20)
    return len(block)


def flood_print() -> None:
    while True:
        print("x" * 1000)


def flood_return(nbytes: int) -> str:
    return "y" * nbytes


def exit_hard(code: int = 3) -> None:
    os._exit(code)


def segfault() -> None:
    ctypes.string_at(0)


def fetch(host: str = "127.0.0.1", port: int = 80) -> str:
    with socket.create_connection((host, port), timeout=2) as s:
        return s.recv(10).decode()


def fetch_quietly(host: str = "127.0.0.1", port: int = 80) -> str:
    """Catches the error itself: the attempt is still reported."""
    try:
        s = socket.socket()
        s.connect((host, port))
    except Exception as err:  # noqa: BLE001
        return f"no network ({type(err).__name__})"
    return "connected"


def raw_connect(port: int = 80) -> str:
    """Around the socket module's Python functions: the network namespace stops it."""
    import _socket

    s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    s.connect(("127.0.0.1", port))
    return "connected"


def fail(message: str) -> None:
    raise ValueError(message)


# ---- issue 38, item 5: output that is not valid UTF-8 text


def surrogate() -> str:
    """Bytes that are not UTF-8, decoded the way os.fsdecode does: a lone surrogate."""
    return "caf" + b"\xc3".decode("utf-8", "surrogateescape") + " ok"


def fail_surrogate() -> None:
    raise ValueError("bad byte \udcff")


# ---- issue 38, item 10: what a tool can reach


def read_file(path: str) -> str:
    with open(path) as f:
        return f.read()


def write_file(path: str, text: str = "x") -> str:
    with open(path, "w") as f:
        f.write(text)
    return path


def listdir(path: str = ".") -> list:
    return sorted(os.listdir(path))


def environment() -> dict:
    return dict(os.environ)


def identity() -> dict:
    return {"uid": os.getuid(), "cwd": os.getcwd(), "home": os.environ.get("HOME")}


def signal_pid(pid: int) -> str:
    os.kill(pid, signal.SIGKILL)
    return "sent"


def leave_daemon(tag: str, then_hang: bool = False) -> str:
    """A grandchild in a session of its own (setsid, then its parent exits), ``tag`` in its
    command line; with ``then_hang`` the call then sleeps past its timeout."""
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import os, time; os.setsid(); os.fork() and os._exit(0); time.sleep(3600)", tag],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child.wait()  # the grandchild exists: forked before its parent exited
    if then_hang:
        time.sleep(3600)
    return "started"
