"""The process tool calls run in (``pipeline.tools.sandbox.ToolExecutor``).

    python -m pipeline.tools.tool_worker FD_IN FD_OUT OWNER_PID MEMORY_MB OUTPUT_BYTES ISOLATION
                                         PRIVATE_DIR SPEC [SPEC ...]

With ISOLATION ``namespaces`` it first enters its namespaces and forks (the child, process 1 of
the new pid namespace, does everything below; the parent waits for it:
``pipeline.tools.isolation``). It imports every SPEC ("package.module:function", through
``pipeline.scoring.rewards.load_function``), shuts itself in and answers ``{"ready": {...}}`` (or
``{"fail": "error", ...}`` when an import fails, ``{"fail": "isolation", ...}`` when the isolation
cannot be set up: it never runs a call less isolated than asked). Then, for every request
``{"name": ..., "arguments": {...}}`` read from FD_IN, it runs ``function(**arguments)``, kills
every process the call started and empties its private directory, and writes one answer to
FD_OUT: ``{"ok": text}`` or ``{"fail": kind, "message": ...}`` with kind ``error`` (an exception,
an unknown tool, bad arguments), ``memory`` (MemoryError under the address-space limit),
``output_limit`` (more than OUTPUT_BYTES printed or returned) or ``network`` (a network call was
attempted). Messages are JSON in ``multiprocessing.connection`` frames (``send_bytes``): the
owner never unpickles what a tool could have written.

Shut in, before the first call:

* processes, files, user, environment: ``pipeline.tools.isolation`` (ISOLATION ``namespaces``: a
  pid namespace, a minimal read-only root whose only writable directory is a private tmpfs, no
  capabilities; ``process``: a private working directory PRIVATE_DIR, no capabilities, what the
  call started killed after it). The environment is the one the owner started it with (only what
  ``tools.pass_env`` names), plus ``HOME`` and ``TMPDIR`` = the private directory;
* network: an empty network namespace (``namespaces``; with ``process`` one is tried,
  ``unshare(CLONE_NEWUSER | CLONE_NEWNET)``, where the kernel allows unprivileged user
  namespaces): no interface is up, so every connection fails, from Python, from C and from a
  subprocess; in any case the ``socket`` module's connecting functions are replaced by one that
  records the attempt and raises, so an attempt is reported as ``network`` even when the tool
  catches the exception;
* memory: ``RLIMIT_AS`` (soft and hard) is what the process maps after the imports plus
  MEMORY_MB, so a call can allocate at most about MEMORY_MB;
* output: stdout and stderr (file descriptors 1 and 2, and ``sys.stdout`` / ``sys.stderr``) go to
  a bounded buffer per call (Python's ``print``) and to /dev/null (file descriptors), stdin reads
  /dev/null.

What the owner does itself: the wall-clock timeout (it kills this process's group, and with it
the pid namespace, and starts a fresh worker), a crash (this process gone: ``os._exit``, a
segfault, the OOM killer). This process dies by SIGKILL with its owner (PR_SET_PDEATHSIG) and
blocks the stop signals (the owner decides when it ends), as the reward worker does.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import resource
import socket
import sys
from multiprocessing.connection import Connection
from typing import Any

from megatron_gspo.lifetime import die_with_parent, shield_from_stop_signals
from pipeline.scoring.rewards import RewardError, load_function
from pipeline.tools.isolation import (PRIVATE_DIR, IsolationError, become_subreaper, build_root,
                                      clear_dir, drop_privileges, end_call_namespaces,
                                      end_call_process, enter_namespaces, import_roots, keep)

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


class NetworkDenied(PermissionError):
    """Raised by every connecting function of the ``socket`` module in a tool worker."""


class OutputLimit(BaseException):
    """The call printed more than the output limit (a BaseException: a tool's ``except
    Exception`` does not swallow it)."""


class _State:
    network_attempts = 0


def _deny(*args: Any, **kwargs: Any) -> Any:
    _State.network_attempts += 1
    raise NetworkDenied("network access is disabled in the tool sandbox")


def isolate_network(*, in_namespace: bool) -> str:
    """Cut this process off the network; returns how ("namespace" or "python").
    ``in_namespace``: it is in an empty network namespace already (``tools.isolation:
    namespaces``); otherwise one is tried (an unprivileged user namespace, if the kernel allows
    it and the process has one thread)."""
    for name in ("connect", "connect_ex", "bind", "sendto", "sendmsg", "listen"):
        setattr(socket.socket, name, _deny)
    for name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr", "socketpair", "fromfd"):
        setattr(socket, name, _deny)
    if in_namespace:
        return "namespace"
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            return "namespace"
    except OSError:
        pass
    return "python"


def address_space_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))


def limit_memory(memory_mb: int, vm_kb: int) -> int:
    """RLIMIT_AS = the address space mapped (``vm_kb``, :func:`address_space_kb`) +
    ``memory_mb``; returns the limit in bytes."""
    limit = vm_kb * 1024 + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return limit


class _BoundedText(io.TextIOBase):
    """``sys.stdout`` / ``sys.stderr`` during a call: keeps at most ``limit`` bytes, raises
    :class:`OutputLimit` past them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        n = len(s.encode("utf-8", errors="replace"))
        if self.size + n > self.limit:
            raise OutputLimit(f"printed more than {self.limit} bytes")
        self.parts.append(s)
        self.size += n
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def _as_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


def run_call(functions: dict, name: str, arguments: Any, output_bytes: int) -> dict:
    """One call: ``{"ok": text}`` (what it printed, then its return value as text) or
    ``{"fail": kind, "message": ...}``."""
    fn = functions.get(name)
    if fn is None:
        return {"fail": "error", "message": f"unknown tool {name!r}; the tools are: "
                                            f"{', '.join(sorted(functions))}"}
    if not isinstance(arguments, dict):
        return {"fail": "error", "message": "the arguments must be a JSON object"}
    attempts = _State.network_attempts
    buffer = _BoundedText(output_bytes)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = buffer
    try:
        value = fn(**arguments)
        text = buffer.text() + _as_text(value)
    except OutputLimit as err:
        return {"fail": "output_limit", "message": str(err)}
    except MemoryError:
        return {"fail": "memory", "message": "the call ran out of its memory limit"}
    except NetworkDenied as err:
        return {"fail": "network", "message": str(err)}
    except TypeError as err:
        return {"fail": "error", "message": f"TypeError: {err}"}
    except Exception as err:  # noqa: BLE001 - the model sees the error, the run goes on
        if _State.network_attempts > attempts:
            return {"fail": "network", "message": "network access is disabled in the tool sandbox"}
        return {"fail": "error", "message": f"{type(err).__name__}: {err}"}
    finally:
        sys.stdout, sys.stderr = saved
    if _State.network_attempts > attempts:  # caught by the tool: still reported
        return {"fail": "network", "message": "network access is disabled in the tool sandbox"}
    if len(text.encode("utf-8", errors="replace")) > output_bytes:
        return {"fail": "output_limit", "message": f"the output exceeds {output_bytes} bytes"}
    return {"ok": text}


def _isolate(isolation: str, private_dir: str, memory_mb: int) -> dict:
    """After the tools' imports: shut this process in (``pipeline.tools.isolation``); what was
    set up, for the ready message. Raises IsolationError."""
    vm_kb = address_space_kb()
    network = isolate_network(in_namespace=isolation == "namespaces")
    info: dict = {"isolation": isolation, "network": network}
    if isolation == "namespaces":
        info.update(build_root(private_dir, binds=import_roots(), private_mb=memory_mb))
        home = PRIVATE_DIR
    else:
        become_subreaper()
        os.chdir(private_dir)
        home = private_dir
    os.environ.update(HOME=home, TMPDIR=home, PWD=home)
    drop_privileges()
    info["home"] = home
    info["address_space_limit"] = limit_memory(memory_mb, vm_kb)
    return info


def main(argv: list[str]) -> int:
    fd_in, fd_out, owner = int(argv[0]), int(argv[1]), int(argv[2])
    memory_mb, output_bytes, isolation, private_dir = int(argv[3]), int(argv[4]), argv[5], argv[6]
    specs = argv[7:]

    die_with_parent()
    shield_from_stop_signals()
    if os.getppid() != owner:  # the owner died before the parent-death signal was armed
        return 1
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # nothing a tool writes reaches the owner's console, nothing is read
        os.dup2(devnull, fd)
    os.close(devnull)
    inbox, outbox = Connection(fd_in, writable=False), Connection(fd_out, readable=False)

    def send(message: dict) -> None:
        outbox.send_bytes(json.dumps(message).encode())

    if isolation == "namespaces":
        try:  # before any import of a tool: a user namespace needs a process with one thread
            enter_namespaces()
        except IsolationError as err:
            send({"fail": "isolation", "message": str(err)})
            return 1
        child = os.fork()
        if child:
            keep(child, (fd_in, fd_out))  # does not return
        die_with_parent()  # process 1 of the pid namespace, dies with the keeper

    functions = {}
    for spec in specs:
        try:
            functions[spec.rpartition(":")[2]] = load_function(spec)
        except RewardError as err:
            send({"fail": "error", "message": str(err).replace("reward.function", "tool")})
            return 1
    try:
        info = _isolate(isolation, private_dir, memory_mb)
    except (IsolationError, OSError) as err:
        send({"fail": "isolation", "message": str(err)})
        return 1
    end_call = end_call_namespaces if isolation == "namespaces" else end_call_process
    send({"ready": info})
    while True:
        try:
            request = json.loads(inbox.recv_bytes())
        except (EOFError, OSError):  # the owner closed the pipe: done
            return 0
        try:
            answer = run_call(functions, request["name"], request["arguments"], output_bytes)
        except MemoryError:
            answer = {"fail": "memory", "message": "the call ran out of its memory limit"}
        # every process the call started is gone, and its files, before the answer is sent
        clean = end_call() and clear_dir(info["home"])
        try:
            send(answer)
        except MemoryError:
            return 3
        if not clean:  # something of the call could not be removed: a fresh worker takes over
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
