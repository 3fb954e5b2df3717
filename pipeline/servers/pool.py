"""Which rollout servers a GSPO run uses: dead ones dropped, embedded ones restarted (rank 0).

A rollout server can die mid-run (a crash, the OOM killer, a lost node). The router already routes
generation around a dead worker; the weight sync reaches every server by itself, so without this
a dead server ended the run at the next sync. Before each sync the loop asks :class:`ServerPool`
which servers to push to (:meth:`ServerPool.check`):

* a server whose process has exited (embedded mode) or that does not answer ``/health`` is taken
  out of the router (so that it gets no request, alive again or not) and out of the weight sync;
* embedded mode: it is restarted on its port (the initial policy, a new sampling seed), still
  out of the router, and included in this sync: :meth:`ServerPool.admit`, after the sync, puts
  it back into the router - it never serves a request with other weights than its peers';
* external mode (servers someone else runs): a dropped server that answers ``/health`` again at
  a later check is synced and admitted the same way;
* fewer than ``rollout.min_servers`` left: :class:`ServerPoolError` (the run stops, saying which
  servers died and where their logs are).

**A server that dies during a rollout** (:meth:`ServerPool.wait_for_live`, the rollout client's
hook: ``RolloutClient(servers=pool)``): a request that fails for want of a server (no answer, or a
5xx such as the router's ``503 No available workers``) asks the pool. While another server serves,
the request is simply sent again. When none does, the rollout in flight waits: embedded mode
restarts the dead servers (the same path as :meth:`check`; a failed restart is tried again every
few seconds), external mode waits for a dropped server to answer ``/health`` again or for the
router to list a new healthy worker (taken out of the router, like a returning one, until it holds
the current weights). The servers that came back get the current weights before they serve: the
pool has every training rank run the loop's weight sync (the same ``sync_weights`` as after a
step: :meth:`check`, the push to the members, :meth:`admit`) through :class:`SyncChannel`, which
the loop opens while rank 0 runs a phase the other ranks wait for (``pipeline.step.rank0.run_on_rank0``).
Then the requests that failed are sent again; the samples already received are kept, so each
request of the batch still yields exactly one sample. A resent request is generated again from
its prompt (same ``sampling_seed``, a new rid): SGLang's non-streaming ``/generate`` returns
nothing of a request whose server died, so there is no partial output to continue from. The wait
is bounded (``outage_timeout_s``): then :class:`ServerPoolError` ``rollout: no live server for N s
(...)`` naming each server, why it is gone and what its restart said (external: the router).

**A server the weight sync has paused** (:attr:`ServerPool.paused`, the pusher's record:
``pipeline.servers.paused``) is alive when its HTTP process answers ``/model_info``: SGLang's
``/health`` generates a token, which waits while the server is paused, and answers 503 after
20 s, so a probe of ``/health`` (a rollout of ``rollout.async: full`` asking during the sync)
would take a paused server for a dead one and drop it from the sync it is in.

**The router after a sync** (:mod:`pipeline.servers.readmission`, ``rollout.router.
readmit_timeout_s``): a router whose health checks ran during the pause may list the resumed
servers unhealthy and answer ``503 No available workers`` until its checks re-admit them.
:meth:`ServerPool.readmitted` (the loop, after each sync) waits until it lists them healthy
again; :meth:`ServerPool.wait_for_router` (the rollout client, for a request that got that 503
while a server serves) waits until it lists a healthy worker. Both are bounded and reported.

``metrics()`` (logged every step): ``rollout/servers_alive`` (servers in the router, serving),
``rollout/server_restarts`` (restarts so far in this process) and ``rollout/requests_retried``
(``/generate`` requests sent again after a failure, so far).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

from pipeline.generation.client import RolloutError, http_json, router_workers
from pipeline.servers.cluster import LocalRolloutCluster, remove_from_router
from pipeline.servers.paused import PausedServers
from pipeline.servers.readmission import RouterReadmission

PROBE_TIMEOUT_S = 30.0
"""How long ``/health`` may take (the local server runs a one-token generation when idle)."""
OUTAGE_TIMEOUT_S = 300.0
"""How long a rollout waits for a live server (restarts included) before it fails."""
OUTAGE_POLL_S = 2.0
"""Between two looks at dead servers while a rollout waits (restarts tried again, /health)."""
READMIT_TIMEOUT_S = 300.0
"""How long the router may take to route to the servers again after a sync
(``rollout.router.readmit_timeout_s``)."""


class ServerPoolError(RuntimeError):
    """Too few rollout servers are left (``rollout.min_servers``)."""


@dataclass
class _Server:
    url: str
    index: Optional[int]  # in the embedded cluster; None for external servers
    state: str = "serving"  # serving | pending (synced next, then admitted) | dropped
    why: str = ""
    died: str = ""  # why it was last found dead (kept while it is restarted)


@dataclass
class ServerPool:
    """Rank 0's view of the rollout servers; see the module docstring.

    ``cluster``: the embedded ``LocalRolloutCluster`` (restarts), or None for external servers;
    ``router_url``: where dropped servers are removed from and restarted ones admitted."""

    server_urls: Sequence[str]
    router_url: Optional[str] = None
    cluster: Optional["LocalRolloutCluster"] = None
    min_servers: int = 1
    probe_timeout_s: float = PROBE_TIMEOUT_S
    outage_timeout_s: float = OUTAGE_TIMEOUT_S
    """:meth:`wait_for_live`: how long a rollout waits for a live server
    (``rollout.outage_timeout_s``)."""
    interrupted: Optional[Callable[[], bool]] = None
    """True once the run is asked to stop (a stop signal): a waiting rollout gives up at once."""
    readmit_timeout_s: float = READMIT_TIMEOUT_S
    """:meth:`readmitted`, :meth:`wait_for_router`: how long the router may take to route to
    the servers again (``rollout.router.readmit_timeout_s``)."""
    paused: PausedServers = field(default_factory=PausedServers)
    """The servers the weight sync has paused now (the loop gives the pusher's record)."""
    liveness_path: Callable[[bool], str] = lambda paused: "/model_info" if paused else "/health"
    """paused -> the GET whose 200 says a server's HTTP process serves (the engine's
    ``ServerControl.liveness_path``; default SGLang's: its ``/health`` waits while paused)."""
    restarts: int = 0
    events: int = 0
    """Drops, restarts and returns so far: a sync retried after a failure compares it."""
    requests_retried: int = 0
    """``/generate`` requests sent again (counted by the rollout client)."""
    channel: "SyncChannel" = field(default_factory=lambda: SyncChannel())
    """How :meth:`wait_for_live` has every rank sync the servers that came back (the loop opens
    it)."""
    _servers: list[_Server] = field(default_factory=list)
    _renewed: list[str] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def __post_init__(self) -> None:
        if self.min_servers < 1:
            raise ValueError(f"min_servers: must be >= 1, got {self.min_servers}")
        urls = [u.rstrip("/") for u in self.server_urls]
        index = {u.rstrip("/"): i for i, u in enumerate(self.cluster.server_urls)} \
            if self.cluster is not None else {}
        self._servers = [_Server(u, index.get(u)) for u in urls]
        if len(urls) < self.min_servers:
            raise ServerPoolError(f"rollout.min_servers: {self.min_servers}, but the run has "
                                  f"{len(urls)} rollout server(s): {urls}")
        self.readmission = (RouterReadmission(self.router_url, self.readmit_timeout_s,
                                              paused=lambda: bool(self.paused),
                                              interrupted=self.interrupted)
                            if self.router_url else None)
        """The waits for the router after a sync (None without a router)."""

    # ------------------------------------------------------------------ the loop's calls
    def members(self) -> list[str]:
        """The servers the next weight sync reaches: serving and pending ones."""
        return [s.url for s in self._servers if s.state != "dropped"]

    def check(self) -> list[str]:
        """Probe every server; drop the dead (router, sync), restart them in embedded mode,
        re-include external ones that answer again; returns :meth:`members`. Raises
        :class:`ServerPoolError` when fewer than ``min_servers`` are left."""
        with self._lock:
            self._probe()
            left = self.members()
            if len(left) < self.min_servers:
                dead = "; ".join(f"{s.url}: {s.why}" for s in self._servers
                                 if s.state == "dropped")
                raise ServerPoolError(
                    f"only {len(left)} of {len(self._servers)} rollout servers left, "
                    f"rollout.min_servers is {self.min_servers} ({dead})")
            return left

    def _probe(self, *, restart_dropped: bool = False) -> None:
        """:meth:`check` without the ``min_servers`` rule; ``restart_dropped``: embedded
        servers whose restart failed before are restarted again (a waiting rollout)."""
        for server in self._servers:
            if server.state == "dropped":
                if server.index is None:
                    if self._answers(server):
                        server.state = "pending"
                        self._remove_from_router(server)  # whoever restarted it may have added it
                        self._renew(server)
                        self._note(f"{server.url} answers again: synced, then back in the "
                                   "router")
                elif restart_dropped:
                    self._restart(server, server.died or server.why)
                continue
            why = self._dead(server)
            if why is None:
                continue
            server.why = server.died = why
            self.events += 1
            self._remove_from_router(server)
            if server.index is None:
                server.state = "dropped"
                self._note(f"{server.url} is gone ({why}): dropped from the router and the "
                           "weight sync")
                continue
            self._note(f"{server.url} is gone ({why}): restarting it (out of the router until "
                       "it holds the current weights)")
            self._restart(server, why)

    def _restart(self, server: _Server, why: str) -> None:
        try:
            self.cluster.restart_server(server.index, register=False)
        except (RolloutError, OSError) as err:
            server.state, server.why = "dropped", f"{why}; its restart failed: {err}"
            self._note(f"{server.url}: restart failed, dropped ({err})")
            return
        self.restarts += 1
        server.state = "pending"
        self._renew(server)

    def take_renewed(self) -> list[str]:
        """Members that are new processes since the last call (restarted, or back): the weight
        sync must make its update groups again for them even if the URLs are the same."""
        renewed, self._renewed = self._renewed, []
        return [u for u in renewed if u in self.members()]

    def admit(self) -> list[str]:
        """After a successful sync: pending servers (restarted or back) join the router; returns
        their URLs."""
        admitted = []
        for server in self._servers:
            if server.state != "pending":
                continue
            if server.index is not None:
                self.cluster.register(server.index)
            elif self.router_url:
                _add_to_router(self.router_url, server.url)
            server.state = "serving"
            admitted.append(server.url)
            self._note(f"{server.url} holds the current weights: back in the router")
        return admitted

    def readmitted(self) -> float:
        """After a sync resumed the servers: wait until the router lists every serving server
        healthy (bounded, reported; :mod:`pipeline.servers.readmission`), except those found
        dead meanwhile (left to the next :meth:`check`); the seconds waited (0.0 without a
        router or when it did at once). Past ``readmit_timeout_s``: ``RouterNotReadmitted``
        naming the router and the servers."""
        if self.readmission is None:
            return 0.0
        serving = {s.url: s for s in self._servers if s.state == "serving"}
        return self.readmission.after_sync(
            list(serving), alive=lambda url: self._dead(serving[url]) is None)

    def wait_for_router(self, answered_at: float, first_at: float) -> None:
        """A rollout request got the router's ``503 No available workers`` at ``answered_at``
        (``time.monotonic()``; its first such answer at ``first_at``) while a server serves:
        return once the router lists a healthy worker again (the rollout client calls this on a
        thread; bounded: :meth:`RouterReadmission.for_request`). Without a router: at once."""
        if self.readmission is not None:
            self.readmission.for_request(answered_at, first_at)

    def metrics(self) -> dict[str, float]:
        return {"rollout/servers_alive": float(sum(s.state == "serving" for s in self._servers)),
                "rollout/server_restarts": float(self.restarts),
                "rollout/requests_retried": float(self.requests_retried)}

    # ------------------------------------------------------------------ a rollout's calls
    def wait_for_live(self, error: Optional[RolloutError] = None) -> bool:
        """A rollout request failed for want of a server (``error``; the rollout client calls
        this on a thread). Returns False at once when a server serves (the request is sent
        again, counted as an attempt); otherwise waits until one serves again - restarted or
        back, synced to the current weights through :attr:`channel`, admitted - and returns
        True. After ``outage_timeout_s``: :class:`ServerPoolError` naming what it waited for."""
        with self._lock:
            if self._serving_alive():
                return False
            start = time.monotonic()
            deadline = start + self.outage_timeout_s
            self._note(f"no live server ({error.message if error else 'no answer'}): the "
                       f"rollout waits for one (at most {self.outage_timeout_s:.0f} s)")
            first = True
            while True:
                self._probe(restart_dropped=not first)
                first = False
                waited = any(s.state == "pending" for s in self._servers)
                if waited:  # waits a while for the sync to be possible
                    self._sync_pending(deadline)
                if self._serving_alive():
                    self._note(f"a server serves again after {time.monotonic() - start:.0f} s: "
                               "the rollout resumes its unfinished requests")
                    return True
                if time.monotonic() >= deadline:
                    raise ServerPoolError(f"rollout: no live server for "
                                          f"{self.outage_timeout_s:.0f} s ({self._describe()})")
                if self.interrupted is not None and self.interrupted():
                    raise ServerPoolError(f"rollout: stopped (a stop signal) after waiting "
                                          f"{time.monotonic() - start:.0f} s for a live server "
                                          f"({self._describe()})")
                if not waited:
                    time.sleep(max(0.0, min(OUTAGE_POLL_S, deadline - time.monotonic())))
                if self.cluster is None:
                    self._adopt_router_workers()

    def _serving_alive(self) -> bool:
        """Whether a serving server is alive now (those found dead are not dropped here: the
        next :meth:`_probe` does that)."""
        return any(s.state == "serving" and self._dead(s) is None for s in self._servers)

    def _sync_pending(self, deadline: float) -> None:
        """The pending servers get the current weights (every rank's weight sync, through
        :attr:`channel`) and are admitted by it; a sync that cannot start soon (before
        ``deadline``, at most ``OUTAGE_POLL_S``) leaves them pending."""
        pending = [s.url for s in self._servers if s.state == "pending"]
        try:  # a while at a time: the caller looks at the servers (and a stop) in between
            ran = self.channel.run(timeout_s=max(0.0, min(OUTAGE_POLL_S,
                                                          deadline - time.monotonic())))
        except Exception as err:  # noqa: BLE001 - named with the servers that waited for it
            raise ServerPoolError(f"rollout: {', '.join(pending)} came back, but the weight "
                                  f"sync that makes it serve failed: {err}") from err
        if not ran:
            for server in self._servers:
                if server.state == "pending":
                    server.why = (f"{server.died or 'came back'}; back and waiting for a weight "
                                  "sync, but no sync could run (every rank must take part)")

    def _describe(self) -> str:
        parts = []
        for s in self._servers:
            if s.state == "serving":
                continue
            why = s.why or s.died or ("back, waiting for the weight sync"
                                      if s.state == "pending" else s.state)
            name = f"server {s.index} at {s.url}" if s.index is not None else s.url
            parts.append(f"{name}: {why}")
        if self.cluster is None and self.router_url:
            try:
                workers = [f"{w['url']} ({'healthy' if w.get('is_healthy') else 'unhealthy'})"
                           for w in router_workers(self.router_url)]
            except RolloutError as err:
                workers = [f"unknown: {err}"]
            parts.append(f"router {self.router_url}: workers {', '.join(workers) or 'none'}")
        return "; ".join(parts) or "no servers"

    def _adopt_router_workers(self) -> None:
        """External mode, no server left: a healthy worker the router lists that the pool does
        not know (someone started a replacement) joins the pool like a returning server:
        out of the router until synced, then admitted."""
        if not self.router_url:
            return

        try:
            workers = router_workers(self.router_url)
        except RolloutError:
            return
        known = {s.url for s in self._servers}
        for worker in workers:
            url = worker["url"].rstrip("/")
            if url in known or not worker.get("is_healthy"):
                continue
            remove_from_router(self.router_url, url)
            server = _Server(url, None, state="pending", died="new worker in the router")
            self._servers.append(server)
            self._renew(server)
            self._note(f"{url}: a new worker in the router: synced, then back in the router")

    # ------------------------------------------------------------------ helpers
    def _renew(self, server: _Server) -> None:
        self.events += 1
        if server.url not in self._renewed:
            self._renewed.append(server.url)

    def _dead(self, server: _Server) -> Optional[str]:
        """Why ``server`` counts as dead, or None. A server the weight sync has paused is asked
        ``/model_info`` (its HTTP process answers it; SGLang's ``/health`` waits while paused)."""
        if server.index is not None:
            code = self.cluster.server_exit_code(server.index)
            if code is not None:
                log = self.cluster.log_path(f"server{server.index}")
                return f"its process exited with status {code}; log {log}"
        path = self.liveness_path(server.url in self.paused)
        try:
            status, _ = http_json("GET", server.url + path, timeout_s=self.probe_timeout_s)
        except RolloutError as err:
            return f"{path}: {err.message}"
        return None if status == 200 else f"{path} answered {status}"

    def _answers(self, server: _Server) -> bool:
        try:
            return http_json("GET", server.url + "/health", timeout_s=5.0)[0] == 200
        except RolloutError:
            return False

    def _remove_from_router(self, server: _Server) -> None:
        if server.index is not None:
            self.cluster.deregister(server.index)
        elif self.router_url:
            remove_from_router(self.router_url, server.url)

    @staticmethod
    def _note(message: str) -> None:
        print(f"rollout servers: {message}", file=sys.stderr, flush=True)


def _add_to_router(router_url: str, server_url: str, timeout_s: float = 120.0) -> None:
    if not any(w["url"].rstrip("/") == server_url for w in router_workers(router_url)):
        status, answer = http_json("POST", router_url.rstrip("/") + "/workers",
                                   {"url": server_url, "worker_type": "regular"}, timeout_s=10.0)
        if status not in (200, 202):
            raise RolloutError(router_url + "/workers", status, str(answer))
    deadline = time.monotonic() + timeout_s
    while not any(w["url"].rstrip("/") == server_url and w.get("is_healthy")
                  for w in router_workers(router_url)):
        if time.monotonic() > deadline:
            raise RolloutError(router_url + "/workers", 200,
                               f"{server_url} not healthy in the router after {timeout_s:.0f} s")
        time.sleep(0.2)


class SyncChannel:
    """How a rollout on rank 0 has every training rank run a weight sync (a collective) while
    the other ranks wait for rank 0's outcome.

    The loop (``pipeline.step.rank0.run_on_rank0``) opens it on rank 0 while it runs a phase the other
    ranks wait for (``with channel.opened(request):``); :meth:`run` (any thread of rank 0: the
    rollout client's hook) waits until it is open and calls ``request()``, which tells the other
    ranks to sync and syncs rank 0's side. The phase's outcome is broadcast only after the
    channel is closed, which waits for a running request: the other ranks always receive the
    request before the outcome. Openings nest (a sync itself runs ``run_on_rank0``); only the
    outermost one's request is used, and a request never runs inside another."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._depth = 0
        self._request: Optional[Callable[[], None]] = None
        self._runner: Optional[int] = None  # the thread running a request

    @contextmanager
    def opened(self, request: Callable[[], None]) -> Iterator[None]:
        with self._cond:
            if self._depth == 0:
                self._request = request
            self._depth += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                me = threading.get_ident()
                while self._runner is not None and self._runner != me:
                    self._cond.wait()
                self._depth -= 1
                if self._depth == 0:
                    self._request = None

    def run(self, timeout_s: float) -> bool:
        """Run the open channel's request (waiting at most ``timeout_s`` for it to open);
        False if it did not open in time. The request's error is raised."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._runner == threading.get_ident():
                raise RuntimeError("a weight sync asked for another one")
            while self._depth == 0 or self._runner is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self._runner, request = threading.get_ident(), self._request
        try:
            request()
        finally:
            with self._cond:
                self._runner = None
                self._cond.notify_all()
        return True
