"""Local rollout servers and the real sglang-router as subprocesses, for CPU machines and tests.

    with LocalRolloutCluster("hf_model_dir", num_servers=2, log_dir="runs/x/rollout") as cluster:
        client = RolloutClient(router_url=cluster.router_url)
        ...
        cluster.restart_server(1)          # kill (if alive), start again on its port, re-register

Each server is ``python -m pipeline.local ...`` (the local rollout server's own entry point, the
server of ``megatron-gspo serve``); the router is
``python -m sglang_router.launch_router`` (sglang-router's own CLI) with ``--model-path`` set to
the local model directory (it loads the tokenizer from there and must never reach for the Hub),
and the servers are registered through its ``POST /workers`` API, as slime does. Every process is
started in a new session (its own process group), with the stop signals blocked
(``megatron_gspo.lifetime.shielded_helper``: a SIGTERM / SIGINT / SIGUSR1 / SIGHUP that reaches
every process of the job, as Slurm's scancel and systemd's stop do, must leave the servers to the
training rank that saves its preemption checkpoint), and logs to ``log_dir/<name>.log``.
``stop()`` (also on an error during start, on ``KeyboardInterrupt`` and at interpreter exit) ends
exactly the process groups this object started, with SIGKILL (they hold no state worth a graceful
exit, and they would not see a SIGTERM); a SIGKILLed owner takes them along (PR_SET_PDEATHSIG).
That signal comes when the *thread* that started a child ends, so a process started off the main
thread (a restart asked for by a rollout's worker thread) is started by a thread of this object
that lives until :meth:`stop`.

**Logs are size-bounded** (:class:`RotatingLog`): a thread of this process copies each child's
output into ``<name>.log`` and rotates it at ``log_max_bytes`` (``<name>.log.1`` ...
``<name>.log.<log_backups>``, the oldest dropped): the router alone logs ~250 KB per GSPO step.

**Servers keep answering ``/health`` while paused**: every server is started with
``pipeline.local.health_env.LAUNCHER_ENV`` (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``)
unless this process's environment sets the variable, so the router's health checks pass during a
weight sync's pause however long it lasts (docs/rollout.md, "The router during a weight sync").

**Dead servers** (``pipeline.servers.pool`` decides): :meth:`deregister` takes a server out of the
router, ``restart_server(i, register=False)`` starts it again without giving it to the router,
and :meth:`register` admits it once it holds the current weights.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import fcntl
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Optional, Sequence

from megatron_gspo.lifetime import shielded_helper
from pipeline.generation.client import RolloutError, http_json, router_workers, wait_healthy
from pipeline.local.health_env import LAUNCHER_ENV

# Set by torchrun / launch.local for training ranks; a server must not inherit them (it is no
# rank: its output goes to its own log, never to a rank's).
_RANK_ONLY_ENV = ("RANK", "LOCAL_RANK", "MEGATRON_GSPO_RANK_LOG_DIR", "MEGATRON_GSPO_STATUS_DIR")

ROUTER_DEFAULT_ARGS = (
    # Notice a dead worker within seconds (defaults: 60 s health checks, 10 failures to open
    # the circuit) and retry an upstream failure on another worker.
    "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
    "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "5",
    "--retry-max-retries", "3", "--worker-startup-timeout-secs", "120",
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


LOG_MAX_BYTES = 16 << 20
LOG_BACKUPS = 2


class RotatingLog:
    """A child's stdout + stderr, copied by a thread of this process into ``path`` and rotated
    when it would pass ``max_bytes``: ``path`` -> ``path.1`` -> ... -> ``path.<backups>``, the
    oldest dropped, so one log never takes more than ``(backups + 1) * max_bytes`` of disk.

        log = RotatingLog(path, max_bytes, backups)
        proc = subprocess.Popen(cmd, stdout=log.fd, stderr=subprocess.STDOUT, ...)
        log.started()         # closes this process's copy of the pipe's write end
        ...
        log.close()           # after the child is gone: the rest of its output, then the file

    The pipe gets the largest buffer the kernel allows (``F_SETPIPE_SZ``, 1 MiB by default), so
    a child writes on while this process is busy; the thread ends at the pipe's end of file.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = LOG_MAX_BYTES,
                 backups: int = LOG_BACKUPS):
        if max_bytes < 1 or backups < 0:
            raise ValueError(f"RotatingLog: max_bytes {max_bytes} (>= 1), backups {backups} (>= 0)")
        self.path, self.max_bytes, self.backups = Path(path), max_bytes, backups
        self._read, self.fd = os.pipe()
        try:
            with open("/proc/sys/fs/pipe-max-size") as f:
                fcntl.fcntl(self._read, getattr(fcntl, "F_SETPIPE_SZ", 1031), int(f.read()))
        except (OSError, ValueError, ImportError):
            pass  # the default 64 KiB buffer
        self._file = open(self.path, "ab")
        self._size = self._file.tell()
        self._thread = threading.Thread(target=self._pump, name=f"log {self.path.name}",
                                        daemon=True)
        self._thread.start()

    def write(self, data: bytes) -> None:
        """Append ``data`` (a header line of this process's own), rotating first if due."""
        if self._size and self._size + len(data) > self.max_bytes:
            self._rotate()
        self._file.write(data)
        self._file.flush()
        self._size += len(data)

    def started(self) -> None:
        """The child holds the write end now; this process's copy goes (or EOF never comes)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self, timeout_s: float = 10.0) -> None:
        self.started()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._file = open(self.path, "ab")
        self._size = 0

    def _pump(self) -> None:
        try:
            while True:
                chunk = os.read(self._read, 1 << 16)
                if not chunk:
                    return
                # whole lines stay in one file where a chunk allows it
                while self._size + len(chunk) > self.max_bytes:
                    room = self.max_bytes - self._size
                    cut = chunk.rfind(b"\n", 0, room) + 1 if room > 0 else 0
                    if cut == 0 and self._size == 0:
                        cut = room  # one line longer than the limit: split it
                    if cut:
                        self._file.write(chunk[:cut])
                        self._size += cut
                        chunk = chunk[cut:]
                    self._rotate()
                if chunk:
                    self._file.write(chunk)
                    self._file.flush()
                    self._size += len(chunk)
        except (OSError, ValueError):
            pass  # the file was closed under us: the owner is shutting down
        finally:
            os.close(self._read)


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalRolloutCluster:
    """N ``megatron-gspo serve`` processes and, optionally, the sglang-router in front of them."""

    health_path = "/health_generate"
    """What a started server answers 200 to once it can generate (a subclass's engine's)."""

    def __init__(self, model_path: str | os.PathLike, num_servers: int, *,
                 host: str = "127.0.0.1", base_port: Optional[int] = None, router: bool = True,
                 log_dir: str | os.PathLike, random_seed: int = 0,
                 router_policy: str = "cache_aware", cpu_threads: int = 1,
                 server_args: Sequence[str] = (), router_args: Sequence[str] = ROUTER_DEFAULT_ARGS,
                 health_timeout_s: float = 180.0, log_max_bytes: int = LOG_MAX_BYTES,
                 log_backups: int = LOG_BACKUPS):
        if num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {num_servers}")
        self.model_path = str(Path(model_path).resolve())
        self.num_servers = num_servers
        self.host = host
        self.log_dir = Path(log_dir)
        self.random_seed = random_seed
        self.router_policy = router_policy
        self.cpu_threads = cpu_threads
        self.server_args = list(server_args)
        self.router_args = list(router_args)
        self.health_timeout_s = health_timeout_s
        self.log_max_bytes, self.log_backups = log_max_bytes, log_backups
        self.use_router = router
        ports = ([base_port + i for i in range(num_servers)] if base_port is not None
                 else [free_port(host) for _ in range(num_servers)])
        self.server_urls = [f"http://{host}:{p}" for p in ports]
        self._ports = ports
        self.router_url: Optional[str] = None
        self._router_port = (base_port + num_servers) if base_port is not None else free_port(host)
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Path] = {}
        self._log_writers: dict[str, RotatingLog] = {}
        self._restarts = [0] * num_servers
        self._atexit = False
        self._spawner: Optional[threading.Thread] = None
        self._spawn_queue: "queue.Queue" = queue.Queue()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "LocalRolloutCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self._atexit:
            atexit.register(self.stop)
            self._atexit = True
        try:
            for i in range(self.num_servers):
                self._start_server(i)
            self._wait_servers(range(self.num_servers))
            if self.use_router:
                self._start_router()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """End every process this cluster started (their process groups), whatever happens:
        SIGKILL, the one signal they do not block (``shielded_helper``)."""
        procs, self._procs = self._procs, {}
        for proc in procs.values():
            self._signal(proc, signal.SIGKILL)
        for proc in procs.values():
            proc.wait(timeout=30)
        writers, self._log_writers = self._log_writers, {}
        for writer in writers.values():
            writer.close()
        if self._spawner is not None:  # its children are gone: it may end
            self._spawn_queue.put(None)
            self._spawner.join(10)
            self._spawner = None
        if self._atexit:
            atexit.unregister(self.stop)
            self._atexit = False

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # the group this object created (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def _spawn(self, name: str, cmd: list[str], defaults: Optional[dict] = None,
               forced: Optional[dict] = None) -> subprocess.Popen:
        """Start ``cmd`` as ``name`` (see the module docstring); ``defaults``: environment
        variables it gets unless this process's environment sets them; ``forced``: ones it gets
        whatever this process's environment says."""
        log_path = self.log_dir / f"{name}.log"
        # A server (``python -m pipeline.local``) silences the benign third-party warnings
        # (pipeline/observe/benign_warnings.py) unless MEGATRON_GSPO_SHOW_WARNINGS is set in this
        # environment, which the server inherits. It is no rank of ours: RANK and the rank-log
        # switch are dropped, so a server started by training rank 1 logs to its own file only.
        env = {**(defaults or {}),
               **{k: v for k, v in os.environ.items() if k not in _RANK_ONLY_ENV}}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.cpu_threads),
                   TOKENIZERS_PARALLELISM="false")
        env.update(forced or {})
        old = self._log_writers.pop(name, None)
        if old is not None:  # a restart: the previous process is gone, its output is in
            old.close()
        log = RotatingLog(log_path, self.log_max_bytes, self.log_backups)
        log.write(f"$ {' '.join(cmd)}\n".encode())
        try:
            # a SIGKILLed owner (e.g. a training rank) leaves no server behind; the job's stop
            # signals do not reach them (the owner stops them, see the module docstring)
            proc = self._popen(cmd, stdout=log.fd, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                               preexec_fn=shielded_helper)
        except BaseException:
            log.close()
            raise
        log.started()
        self._procs[name] = proc
        self._logs[name] = log_path
        self._log_writers[name] = log
        return proc

    def _popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        """``subprocess.Popen`` from a thread that outlives the child's use: the main thread, or
        this object's spawner thread (PR_SET_PDEATHSIG fires when the forking thread ends)."""
        if threading.current_thread() is threading.main_thread():
            return subprocess.Popen(cmd, **kwargs)
        if self._spawner is None or not self._spawner.is_alive():
            self._spawner = threading.Thread(target=self._spawn_loop, daemon=True,
                                             name="rollout-spawner")
            self._spawner.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._spawn_queue.put((cmd, kwargs, done))
        return done.result()

    def _spawn_loop(self) -> None:
        while (item := self._spawn_queue.get()) is not None:
            cmd, kwargs, done = item
            try:
                done.set_result(subprocess.Popen(cmd, **kwargs))
            except BaseException as err:  # noqa: BLE001 - raised in the asking thread
                done.set_exception(err)

    # ------------------------------------------------------------------ servers
    def _start_server(self, i: int) -> None:
        cmd = [sys.executable, "-m", "pipeline.local", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self._ports[i]),
               "--random-seed", str(self.random_seed + 1000 * i + self._restarts[i]),
               "--cpu-threads", str(self.cpu_threads), *self.server_args]
        self._spawn(f"server{i}", cmd, defaults=LAUNCHER_ENV)

    def _wait_servers(self, indices) -> None:
        indices = list(indices)
        deadline = time.monotonic() + self.health_timeout_s
        pending = list(indices)
        while pending:
            for i in pending:
                proc = self._procs[f"server{i}"]
                if proc.poll() is not None:
                    raise RolloutError(self.server_urls[i], None,
                                       f"server process exited with code {proc.returncode} before "
                                       f"it became healthy; log {self._logs[f'server{i}']}:\n"
                                       + _log_tail(self._logs[f"server{i}"]))
            left = deadline - time.monotonic()
            try:
                wait_healthy([self.server_urls[i] for i in pending], min(2.0, max(0.5, left)),
                             path=self.health_path)
                return
            except RolloutError as err:
                if time.monotonic() > deadline:
                    raise RolloutError(err.url, err.status, f"{err.message}; log tail:\n"
                                       + _log_tail(self._logs[f"server{pending[0]}"])) from None

    def kill_server(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill server ``i`` (SIGKILL by default: it dies mid-request, as a crash would)."""
        proc = self._procs.get(f"server{i}")
        if proc is not None:
            self._signal(proc, sig)
            proc.wait(timeout=30)

    def server_alive(self, i: int) -> bool:
        proc = self._procs.get(f"server{i}")
        return proc is not None and proc.poll() is None

    def server_exit_code(self, i: int) -> Optional[int]:
        """The exit status of server ``i``'s process, None while it runs."""
        proc = self._procs.get(f"server{i}")
        return None if proc is None else proc.poll()

    def restart_server(self, i: int, *, register: bool = True) -> None:
        """Kill server ``i`` if it runs, start it again on its port and wait until healthy; with
        ``register`` make sure the router lists it (``POST /workers`` when it does not), without
        it leave it out of the router (:meth:`register` admits it later).

        The router first forgets the old worker (``DELETE /workers``): its circuit breaker, opened
        by the requests the dead server failed, would otherwise keep the restarted one idle for
        ``--cb-timeout-duration-secs``; a re-added worker starts with a closed circuit."""
        self.deregister(i)
        self.kill_server(i)
        self._restarts[i] += 1
        self._start_server(i)
        self._wait_servers([i])
        if register:
            self.register(i)

    def register(self, i: int) -> None:
        """Put server ``i`` into the router (if not listed) and wait until it is healthy there."""
        if self.router_url:
            self._register(self.server_urls[i])
            self._wait_router_healthy([self.server_urls[i]])

    def deregister(self, i: int) -> None:
        """Take server ``i`` out of the router (``DELETE /workers/<id>``) and wait until it is
        gone: the router sends it no request, whether it is dead or being restarted."""
        if self.router_url:
            remove_from_router(self.router_url, self.server_urls[i],
                               timeout_s=self.health_timeout_s)

    # ------------------------------------------------------------------ router
    def _start_router(self) -> None:
        port = self._router_port
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", self.host,
               "--port", str(port), "--policy", self.router_policy,
               "--model-path", self.model_path,
               "--prometheus-host", self.host, "--prometheus-port", str(free_port(self.host)),
               "--log-level", "info", *self.router_args]
        proc = self._spawn("router", cmd)
        url = f"http://{self.host}:{port}"
        deadline = time.monotonic() + self.health_timeout_s
        while True:  # the router answers /health as soon as it listens
            if proc.poll() is not None:
                raise RolloutError(url, None, f"router exited with code {proc.returncode}; log "
                                   f"{self._logs['router']}:\n" + _log_tail(self._logs["router"]))
            try:
                status, _ = http_json("GET", url + "/health", timeout_s=2.0)
                if status == 200:
                    break
            except RolloutError:
                pass
            if time.monotonic() > deadline:
                raise RolloutError(url, None, "router did not start listening; log tail:\n"
                                   + _log_tail(self._logs["router"]))
            time.sleep(0.2)
        self.router_url = url
        for server in self.server_urls:
            self._register(server)
        self._wait_router_healthy(self.server_urls)

    def _register(self, server_url: str) -> None:
        listed = {w["url"].rstrip("/"): w for w in router_workers(self.router_url)}
        if server_url in listed:
            return
        status, answer = http_json("POST", self.router_url + "/workers",
                                   {"url": server_url, "worker_type": "regular"}, timeout_s=10.0)
        if status not in (200, 202):
            raise RolloutError(self.router_url + "/workers", status, str(answer))

    def _wait_router_healthy(self, urls: Sequence[str]) -> None:
        deadline = time.monotonic() + self.health_timeout_s
        while True:
            workers = {w["url"].rstrip("/"): w for w in router_workers(self.router_url)}
            missing = [u for u in urls if not workers.get(u, {}).get("is_healthy")]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise RolloutError(self.router_url + "/workers", 200,
                                   f"workers not healthy in the router after "
                                   f"{self.health_timeout_s:.0f} s: {missing}; router log "
                                   f"{self._logs['router']}")
            time.sleep(0.2)

    def log_paths(self, name: str) -> list[Path]:
        """``name``'s log and its rotated predecessors that exist, newest first."""
        path = self._logs[name]
        return [p for p in [path, *(path.with_name(f"{path.name}.{i}")
                                    for i in range(1, self.log_backups + 1))] if p.exists()]

    def router_worker_urls(self) -> list[str]:
        return [w["url"].rstrip("/") for w in router_workers(self.router_url)]

    def log_path(self, name: str) -> Path:
        return self._logs[name]


def remove_from_router(router_url: str, server_url: str, *, timeout_s: float = 60.0) -> bool:
    """Take ``server_url`` out of the sglang-router at ``router_url`` (``DELETE /workers/<id>``,
    which the router applies in the background) and wait until it no longer lists it; returns
    whether it was listed."""
    server_url = server_url.rstrip("/")
    listed = [w for w in router_workers(router_url) if w["url"].rstrip("/") == server_url]
    for worker in listed:
        ident = urllib.parse.quote(str(worker.get("id") or worker["url"]), safe="")
        status, answer = http_json("DELETE", f"{router_url.rstrip('/')}/workers/{ident}",
                                   timeout_s=10.0)
        if status not in (200, 202, 404):
            raise RolloutError(f"{router_url}/workers/{ident}", status, str(answer))
    deadline = time.monotonic() + timeout_s
    while any(w["url"].rstrip("/") == server_url for w in router_workers(router_url)):
        if time.monotonic() > deadline:
            raise RolloutError(router_url + "/workers", 200, f"{server_url} still listed "
                               f"{timeout_s:.0f} s after its removal")
        time.sleep(0.2)
    return bool(listed)
