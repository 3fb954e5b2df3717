"""Local rollout servers and the real sglang-router as subprocesses, for CPU machines and tests.

    with LocalRolloutCluster("hf_model_dir", num_servers=2, log_dir="runs/x/rollout") as cluster:
        client = RolloutClient(router_url=cluster.router_url)
        ...
        cluster.restart_server(1)          # kill (if alive), start again on its port, re-register

Each server is ``python -m launch.cli serve ...`` (``megatron-gspo serve``); the router is
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
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from megatron_gspo.lifetime import shielded_helper
from pipeline.rollout import RolloutError, http_json, router_workers, wait_healthy

# Set by torchrun / launch.local for training ranks; a server must not inherit them (launch.cli
# would take it for a rank and redirect its output to the rank's log).
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


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class LocalRolloutCluster:
    """N ``megatron-gspo serve`` processes and, optionally, the sglang-router in front of them."""

    def __init__(self, model_path: str | os.PathLike, num_servers: int, *,
                 host: str = "127.0.0.1", base_port: Optional[int] = None, router: bool = True,
                 log_dir: str | os.PathLike, random_seed: int = 0,
                 router_policy: str = "cache_aware", cpu_threads: int = 1,
                 server_args: Sequence[str] = (), router_args: Sequence[str] = ROUTER_DEFAULT_ARGS,
                 health_timeout_s: float = 180.0):
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
        self.use_router = router
        ports = ([base_port + i for i in range(num_servers)] if base_port is not None
                 else [free_port(host) for _ in range(num_servers)])
        self.server_urls = [f"http://{host}:{p}" for p in ports]
        self._ports = ports
        self.router_url: Optional[str] = None
        self._router_port = (base_port + num_servers) if base_port is not None else free_port(host)
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, Path] = {}
        self._restarts = [0] * num_servers
        self._atexit = False

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

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log_path = self.log_dir / f"{name}.log"
        # A server is ``launch.cli serve``: cli.main silences the benign third-party warnings
        # (launch/benign_warnings.py) unless MEGATRON_GSPO_SHOW_WARNINGS is set in this
        # environment, which the server inherits. It is no rank of ours: RANK and the rank-log
        # switch are dropped, so a server started by training rank 1 logs to its own file only.
        env = {k: v for k, v in os.environ.items() if k not in _RANK_ONLY_ENV}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(self.cpu_threads),
                   TOKENIZERS_PARALLELISM="false")
        with open(log_path, "ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            # a SIGKILLed owner (e.g. a training rank) leaves no server behind; the job's stop
            # signals do not reach them (the owner stops them, see the module docstring)
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=env,
                                    preexec_fn=shielded_helper)
        self._procs[name] = proc
        self._logs[name] = log_path
        return proc

    # ------------------------------------------------------------------ servers
    def _start_server(self, i: int) -> None:
        cmd = [sys.executable, "-m", "launch.cli", "serve", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self._ports[i]),
               "--random-seed", str(self.random_seed + 1000 * i + self._restarts[i]),
               "--cpu-threads", str(self.cpu_threads), *self.server_args]
        self._spawn(f"server{i}", cmd)

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
                wait_healthy([self.server_urls[i] for i in pending], min(2.0, max(0.5, left)))
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

    def restart_server(self, i: int) -> None:
        """Kill server ``i`` if it runs, start it again on its port, wait until healthy and make
        sure the router lists it (``POST /workers`` when it does not)."""
        self.kill_server(i)
        self._restarts[i] += 1
        self._start_server(i)
        self._wait_servers([i])
        if self.router_url:
            self._register(self.server_urls[i])
            self._wait_router_healthy([self.server_urls[i]])

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

    def router_worker_urls(self) -> list[str]:
        return [w["url"].rstrip("/") for w in router_workers(self.router_url)]

    def log_path(self, name: str) -> Path:
        return self._logs[name]
