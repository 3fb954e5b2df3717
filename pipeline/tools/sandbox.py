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
                   has left), then kills the worker with all it started (its pid
                   namespace); a fresh worker takes the next call
memory             ``RLIMIT_AS``: the worker's address space after its imports plus    ``memory``
                   ``memory_mb`` (a MemoryError; the worker is replaced)
output             at most ``output_bytes`` printed (``print`` raises past it) and     ``output_limit``
                   returned together
network            an empty network namespace (``process``: where the kernel allows    ``network``
                   it), and the ``socket`` module's connecting functions always raise
                   (the attempt is reported even if the tool catches the error)
crash              the worker died (``os._exit``, a segfault, the OOM killer); a       ``crash``
                   fresh worker takes the next call
text               an answer that is not valid UTF-8 text (a lone surrogate, as        ``encoding``
                   ``bytes.decode(errors="surrogateescape")`` makes it): shown to
                   the model with U+FFFD in its place
anything else      an exception, an unknown tool, bad arguments                        ``error``
=================  ==================================================================  ==============

Processes, files, the user and the environment: ``isolation`` (``tools.isolation``,
``pipeline.tools.isolation``): by default a pid, mount, user, network and IPC namespace, a
minimal read-only root with one private writable directory, no capabilities, and every process
a call started killed at its end; the environment holds only what ``pass_env``
(``tools.pass_env``) names. When the isolation asked for cannot be set up, the first call raises
:class:`ToolIsolationError` naming ``tools.isolation`` (:meth:`ToolExecutor.check`, run by the
preflight, finds it before a run starts): a tool never runs less isolated than configured.

A failed call is a :class:`ToolOutcome` with ``ok`` False, its ``error`` kind and an ``output``
text for the model (``error: <kind>: <what happened>``, appended as that call's tool response):
the trajectory, the step and the run go on. ``call`` is thread-safe: up to ``workers`` calls run
at once, the others wait for a worker. With ``interrupted`` (the rank's stop flag), a call
waiting for its worker or its answer is abandoned within :data:`POLL_S` of a stop signal (the
worker killed, :class:`ToolsInterrupted` raised), so that a stop never waits for slow tools.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from megatron_gspo.errors import InputError
from pipeline.scoring.rewards import RewardError, load_function, start_piped_worker
from pipeline.tools.isolation import LEVELS, clear_dir, kill_tree

ERROR_KINDS = ("timeout", "memory", "output_limit", "crash", "network", "encoding", "error")
"""The reasons a tool call fails (``ToolOutcome.error``)."""

POLL_S = 0.05
"""How often a call waiting for a worker or an answer looks at ``interrupted``."""


class ToolIsolationError(RuntimeError, InputError):
    """The isolation ``tools.isolation`` asks for cannot be set up on this machine."""


class ToolsInterrupted(RuntimeError):
    """A stop signal came while a tool call waited or ran: it was abandoned (its worker killed),
    so that the rank can save its checkpoint and stop (``pipeline.step.step_guard.StepGuard``)."""


def valid_text(text: str) -> tuple[str, Optional[str]]:
    """``text`` as valid UTF-8 text and None, or with every lone surrogate replaced by U+FFFD and
    what was wrong."""
    try:
        text.encode("utf-8")
        return text, None
    except UnicodeEncodeError as err:
        bad = text[err.start]
        return ("".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text),
                f"lone surrogate U+{ord(bad):04X} at character {err.start}")


def tool_environment(pass_env: Sequence[str]) -> dict[str, str]:
    """A tool worker's environment: a ``PATH`` (the run's Python first) and ``LANG``, plus the
    run's variables that ``pass_env`` names (those set); nothing else of the run's environment
    (its tokens, keys and paths). The worker adds ``PYTHONPATH``, ``HOME`` and ``TMPDIR``."""
    env = {"PATH": os.pathsep.join([os.path.dirname(sys.executable), "/usr/local/bin",
                                    "/usr/bin", "/bin"]),
           "LANG": "C.UTF-8"}
    env.update({name: os.environ[name] for name in pass_env if name in os.environ})
    return env

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
    """One worker process and its pipes (owner side), with its private directory."""

    def __init__(self, tools: dict[str, str], limits: ToolLimits, *, isolation: str,
                 env: dict[str, str]):
        self.isolation = isolation
        # namespaces: the mount point of the worker's own root (empty here); process: its files
        self.private_dir = tempfile.mkdtemp(prefix="megatron-gspo-tool-")
        try:
            self.proc, self.inbox, self.outbox = start_piped_worker(
                "pipeline.tools.tool_worker",
                lambda fd_in, fd_out: [str(fd_in), str(fd_out), str(os.getpid()),
                                       str(limits.memory_mb), str(limits.output_bytes),
                                       isolation, self.private_dir, *tools.values()],
                base_env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except BaseException:
            os.rmdir(self.private_dir)
            raise
        self.max_answer_bytes = 8 * limits.output_bytes + 4096  # JSON escapes at most 6x
        self.info: Optional[dict] = None

    def wait_ready(self) -> Optional[str]:
        """None once the worker is ready, else why it is not; raises
        :class:`ToolIsolationError` when it could not shut itself in."""
        got = self.receive(WORKER_START_TIMEOUT_S)
        if got is None:
            return f"the worker did not start within {WORKER_START_TIMEOUT_S:g} s"
        if "ready" in got:
            self.info = got["ready"]
            return None
        if got.get("fail") == "isolation":
            raise ToolIsolationError(
                f"tools.isolation: {self.isolation!r} cannot be set up on this machine: "
                f"{valid_text(str(got.get('message')))[0]}"
                + ("; tools.isolation: process runs the tools without namespaces (they can then "
                   "read and write what the run's user can: docs/tools.md)"
                   if self.isolation == "namespaces" else ""))
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
        """The worker and everything it started: its process group, and with ``namespaces``
        its pid namespace (its process 1 dies with it); with ``process`` every process below it
        first, wherever it moved."""
        if self.proc.poll() is None:
            if self.isolation == "process":
                kill_tree(self.proc.pid)
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
        if os.path.isdir(self.private_dir):
            clear_dir(self.private_dir)
            shutil.rmtree(self.private_dir, ignore_errors=True)


class ToolExecutor:
    """Runs tool calls in worker processes under :class:`ToolLimits` (see the module docstring).

    ``tools``: name -> "module:function" (:func:`load_tools`). ``isolation``: one of
    ``pipeline.tools.isolation.LEVELS`` (``tools.isolation``); ``pass_env``: the names of the
    run's environment variables the tools see (``tools.pass_env``); ``interrupted``: the rank's
    "a stop signal came". ``stats`` counts calls and failures by kind, and worker starts."""

    def __init__(self, tools: dict[str, str], limits: ToolLimits, *, workers: int = 4,
                 isolation: str = "namespaces", pass_env: Sequence[str] = (),
                 interrupted: Optional[Callable[[], bool]] = None):
        if workers < 1:
            raise ValueError(f"tools.workers: must be >= 1, got {workers}")
        if isolation not in LEVELS:
            raise ValueError(f"tools.isolation: expected one of {list(LEVELS)}, got {isolation!r}")
        self.tools = dict(tools)
        self.limits = limits
        self.isolation = isolation
        self.env = tool_environment(pass_env)
        self.interrupted = interrupted
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
        worker = _Worker(self.tools, self.limits, isolation=self.isolation, env=self.env)
        with self._lock:
            self._live.add(worker)
            self.stats["worker_starts"] += 1
        try:
            why = worker.wait_ready()
        except ToolIsolationError:
            self._drop(worker)
            raise
        if why is not None:
            self._drop(worker)
            return None, why
        self.network_isolation = worker.info.get("network")
        return worker, None

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)

    def check(self) -> dict:
        """Start one worker and stop it: what its ready message says (isolation, network).
        Raises :class:`ToolIsolationError` (the isolation cannot be set up), RuntimeError (the
        worker could not start)."""
        worker, why = self._start()
        if worker is None:
            raise RuntimeError(f"tools: the sandbox's worker did not start: {why}")
        self._drop(worker)
        return dict(worker.info or {})

    def _stopped(self) -> bool:
        return self.interrupted is not None and self.interrupted()

    def _take_worker(self) -> Optional[_Worker]:
        """An idle worker slot (None: start one); raises :class:`ToolsInterrupted` on a stop."""
        while True:
            if self._stopped():
                raise ToolsInterrupted("a stop signal came while a tool call waited for a "
                                       "sandbox worker: the call was abandoned")
            try:
                return self._idle.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def call(self, name: str, arguments: Any, *, timeout_s: Optional[float] = None) -> ToolOutcome:
        """Run ``name(**arguments)``; at most ``min(limits.timeout_s, timeout_s)`` seconds.
        Raises :class:`ToolsInterrupted` after a stop signal (``interrupted``),
        :class:`ToolIsolationError` when a worker cannot be shut in."""
        if self._closed:
            raise RuntimeError("ToolExecutor.call after close()")
        limit = self.limits.timeout_s if timeout_s is None else min(self.limits.timeout_s,
                                                                     timeout_s)
        self._count("calls")
        if name not in self.tools:
            self._count("error/error")
            return failure("error", f"unknown tool {name!r}; the tools are: "
                                    f"{', '.join(self.tools) or 'none'}", 0.0)
        worker = self._take_worker()
        try:
            if worker is None or not worker.alive():
                if worker is not None:
                    self._drop(worker)
                worker, why = self._start()
                if worker is None:
                    self._count("error/crash")
                    return failure("crash", why, 0.0)
            try:
                outcome = self._run(worker, name, arguments, limit)
            except ToolsInterrupted:
                self._drop(worker)  # the call in flight is abandoned with its worker
                worker = None
                raise
            if outcome.error in ("timeout", "crash", "memory"):
                self._drop(worker)  # a fresh worker for the next call
                worker = None
            return outcome
        finally:
            self._idle.put(worker)

    def _answer(self, worker: _Worker, limit: float, start: float) -> Optional[dict]:
        """The worker's answer, None past ``limit``; a stop signal meanwhile raises
        :class:`ToolsInterrupted`."""
        deadline = start + limit
        while True:
            if self._stopped():
                raise ToolsInterrupted(f"a stop signal came while a tool call ran "
                                       f"({time.monotonic() - start:.1f} s of its {limit:.3g} s):"
                                       " the call was abandoned")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            answer = worker.receive(min(POLL_S, left) if self.interrupted is not None else left)
            if answer is not None:
                return answer

    def _run(self, worker: _Worker, name: str, arguments: Any, limit: float) -> ToolOutcome:
        start = time.monotonic()
        try:
            worker.outbox.send_bytes(json.dumps({"name": name, "arguments": arguments}).encode())
        except (OSError, TypeError, ValueError, RecursionError) as err:
            if isinstance(err, OSError):
                self._count("error/crash")
                return failure("crash", worker.how_it_ended(), time.monotonic() - start)
            self._count("error/error")
            return failure("error", f"arguments not JSON: {type(err).__name__}", 0.0)
        answer = self._answer(worker, limit, start)
        seconds = time.monotonic() - start
        if answer is None:
            self._count("error/timeout")
            return failure("timeout", f"the call ran past {limit:.3g} s and was stopped", seconds)
        if "ok" in answer:
            text, wrong = valid_text(str(answer["ok"]))
            if wrong is None:
                return ToolOutcome(ok=True, output=text, seconds=seconds)
            self._count("error/encoding")  # data, not a crash: the model sees it, sanitised
            return failure("encoding", f"the output is not valid UTF-8 text ({wrong}); as text: "
                                       f"{text}", seconds)
        kind = answer.get("fail") if answer.get("fail") in ERROR_KINDS else "error"
        self._count(f"error/{kind}")
        return failure(kind, valid_text(str(answer.get("message", "")))[0], seconds)

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
