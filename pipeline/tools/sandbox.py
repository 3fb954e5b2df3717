"""The sandboxed tool executor: tool calls out of process, with limits; a failure costs the call.

Tools are registered as "package.module:function" (``tools.functions``), like a reward function
(``pipeline.scoring.rewards.load_function``: imported here once, so a wrong spec fails at start-up naming
``tools.functions[i]``); a tool's name is its function's name. A call ``name(**arguments)`` runs
in one of ``workers`` worker processes (``pipeline.tools.tool_worker``, started at first use and kept:
module state such as a loaded table lives there), under :class:`ToolLimits`:

=================  ==================================================================  ==============
limit              how                                                                 error kind
=================  ==================================================================  ==============
wall clock         the owner waits ``timeout_s`` (or what the trajectory's tool time   ``timeout``
                   has left), then kills the worker's process group; a fresh worker
                   takes the next call
memory             ``RLIMIT_AS``: the worker's address space after its imports plus    ``memory``
                   ``memory_mb`` (a MemoryError; the worker is replaced)
output             at most ``output_bytes`` printed (``print`` raises past it) and     ``output_limit``
                   returned together
network            an empty network namespace where the kernel allows it, and the      ``network``
                   ``socket`` module's connecting functions always raise (the attempt
                   is reported even if the tool catches the error)
crash              the worker died (``os._exit``, a segfault, the OOM killer); a       ``crash``
                   fresh worker takes the next call
anything else      an exception, an unknown tool, bad arguments                        ``error``
=================  ==================================================================  ==============

A failed call is a :class:`ToolOutcome` with ``ok`` False, its ``error`` kind and an ``output``
text for the model (``error: <kind>: <what happened>``, appended as that call's tool response):
the trajectory, the step and the run go on. ``call`` is thread-safe: up to ``workers`` calls run
at once, the others wait for a worker.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from pipeline.scoring.rewards import RewardError, load_function, start_piped_worker

ERROR_KINDS = ("timeout", "memory", "output_limit", "crash", "network", "error")
"""The reasons a tool call fails (``ToolOutcome.error``)."""

WORKER_START_TIMEOUT_S = 60.0
"""How long a worker may take to start (Python and the tools' imports); past it the call fails
with ``crash``."""


@dataclass(frozen=True, kw_only=True)
class ToolLimits:
    timeout_s: float = 5.0
    """Wall-clock seconds one call may run."""
    memory_mb: int = 512
    """Memory one call may allocate (address space over the worker's after its imports)."""
    output_bytes: int = 4096
    """Bytes a call may print and return, together."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"tools.timeout_s: must be > 0, got {self.timeout_s}")
        if self.memory_mb < 1:
            raise ValueError(f"tools.memory_mb: must be >= 1, got {self.memory_mb}")
        if self.output_bytes < 1:
            raise ValueError(f"tools.output_bytes: must be >= 1, got {self.output_bytes}")


@dataclass(frozen=True, kw_only=True)
class ToolOutcome:
    """One call's result: ``output`` is what the model is shown (the tool's text, or the error)."""

    ok: bool
    output: str
    error: Optional[str] = None
    """None when ok, else one of :data:`ERROR_KINDS`."""
    seconds: float = 0.0
    """Wall time of the call (sending the request to the answer or the kill)."""


def load_tools(specs: list[str]) -> dict[str, str]:
    """Tool name -> spec, each imported once here (``tools.functions[i]: ...`` on failure)."""
    tools: dict[str, str] = {}
    for i, spec in enumerate(specs):
        try:
            load_function(spec)
        except RewardError as err:
            raise ValueError(f"tools.functions[{i}]: "
                             f"{str(err).replace('reward.function ', '')}") from err
        name = spec.rpartition(":")[2]
        if name in tools:
            raise ValueError(f"tools.functions[{i}]: a second tool named {name!r} "
                             f"({tools[name]!r} is the first)")
        tools[name] = spec
    return tools


def failure(kind: str, message: str, seconds: float) -> ToolOutcome:
    return ToolOutcome(ok=False, output=f"error: {kind}: {message}", error=kind, seconds=seconds)


class _Worker:
    """One worker process and its pipes (owner side)."""

    def __init__(self, tools: dict[str, str], limits: ToolLimits):
        self.proc, self.inbox, self.outbox = start_piped_worker(
            "pipeline.tools.tool_worker",
            lambda fd_in, fd_out: [str(fd_in), str(fd_out), str(os.getpid()),
                                   str(limits.memory_mb), str(limits.output_bytes),
                                   *tools.values()],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.max_answer_bytes = 8 * limits.output_bytes + 4096  # JSON escapes at most 6x
        self.info: Optional[dict] = None

    def wait_ready(self) -> Optional[str]:
        """None once the worker is ready, else why it is not."""
        got = self.receive(WORKER_START_TIMEOUT_S)
        if got is None:
            return f"the worker did not start within {WORKER_START_TIMEOUT_S:g} s"
        if "ready" in got:
            self.info = got["ready"]
            return None
        return got.get("message") or self.how_it_ended()

    def receive(self, timeout_s: float) -> Optional[dict]:
        """The next answer; None past ``timeout_s``; ``{"fail": "crash"}`` if the worker is gone."""
        try:
            if not self.inbox.poll(max(0.0, timeout_s)):
                return None
            return json.loads(self.inbox.recv_bytes(self.max_answer_bytes))
        except (EOFError, OSError, ValueError):
            return {"fail": "crash", "message": self.how_it_ended()}

    def how_it_ended(self) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the worker stopped answering"
        if code < 0:
            try:
                return f"the tool's process was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"the tool's process was killed by signal {-code}"
        return f"the tool's process exited with status {code}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for conn in (self.inbox, self.outbox):
            conn.close()


class ToolExecutor:
    """Runs tool calls in worker processes under :class:`ToolLimits` (see the module docstring).

    ``tools``: name -> "module:function" (:func:`load_tools`). ``stats`` counts calls and
    failures by kind, and worker starts."""

    def __init__(self, tools: dict[str, str], limits: ToolLimits, *, workers: int = 4):
        if workers < 1:
            raise ValueError(f"tools.workers: must be >= 1, got {workers}")
        self.tools = dict(tools)
        self.limits = limits
        self._idle: "queue.SimpleQueue[Optional[_Worker]]" = queue.SimpleQueue()
        for _ in range(workers):
            self._idle.put(None)  # started at first use
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self._closed = False
        self.stats: dict[str, int] = {"calls": 0, "worker_starts": 0,
                                      **{f"error/{k}": 0 for k in ERROR_KINDS}}
        self.network_isolation: Optional[str] = None
        """How the workers are cut off the network: "namespace" or "python" (after a start)."""

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _start(self) -> tuple[Optional[_Worker], Optional[str]]:
        worker = _Worker(self.tools, self.limits)
        with self._lock:
            self._live.add(worker)
            self.stats["worker_starts"] += 1
        why = worker.wait_ready()
        if why is not None:
            self._drop(worker)
            return None, why
        self.network_isolation = worker.info.get("network")
        return worker, None

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)

    def call(self, name: str, arguments: Any, *, timeout_s: Optional[float] = None) -> ToolOutcome:
        """Run ``name(**arguments)``; at most ``min(limits.timeout_s, timeout_s)`` seconds."""
        if self._closed:
            raise RuntimeError("ToolExecutor.call after close()")
        limit = self.limits.timeout_s if timeout_s is None else min(self.limits.timeout_s,
                                                                     timeout_s)
        self._count("calls")
        if name not in self.tools:
            self._count("error/error")
            return failure("error", f"unknown tool {name!r}; the tools are: "
                                    f"{', '.join(self.tools) or 'none'}", 0.0)
        worker = self._idle.get()
        try:
            if worker is None or not worker.alive():
                if worker is not None:
                    self._drop(worker)
                worker, why = self._start()
                if worker is None:
                    self._count("error/crash")
                    return failure("crash", why, 0.0)
            outcome = self._run(worker, name, arguments, limit)
            if outcome.error in ("timeout", "crash", "memory"):
                self._drop(worker)  # a fresh worker for the next call
                worker = None
            return outcome
        finally:
            self._idle.put(worker)

    def _run(self, worker: _Worker, name: str, arguments: Any, limit: float) -> ToolOutcome:
        start = time.monotonic()
        try:
            worker.outbox.send_bytes(json.dumps({"name": name, "arguments": arguments}).encode())
        except (OSError, TypeError, ValueError) as err:
            if isinstance(err, OSError):
                self._count("error/crash")
                return failure("crash", worker.how_it_ended(), time.monotonic() - start)
            self._count("error/error")
            return failure("error", f"arguments not JSON: {err}", 0.0)
        answer = worker.receive(limit)
        seconds = time.monotonic() - start
        if answer is None:
            self._count("error/timeout")
            return failure("timeout", f"the call ran past {limit:.3g} s and was stopped", seconds)
        if "ok" in answer:
            return ToolOutcome(ok=True, output=str(answer["ok"]), seconds=seconds)
        kind = answer.get("fail") if answer.get("fail") in ERROR_KINDS else "error"
        self._count(f"error/{kind}")
        return failure(kind, str(answer.get("message", "")), seconds)

    def close(self) -> None:
        """Kill every worker; ``call`` refuses afterwards."""
        self._closed = True
        with self._lock:
            live = list(self._live)
        for worker in live:
            self._drop(worker)

    def __enter__(self) -> "ToolExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
