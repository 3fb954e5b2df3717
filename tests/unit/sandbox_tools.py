"""Tools for the sandbox tests (registered as "tests.unit.sandbox_tools:NAME")."""

from __future__ import annotations

import ctypes
import os
import socket
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
