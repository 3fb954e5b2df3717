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

``metrics()`` (logged every step): ``rollout/servers_alive`` (servers in the router, serving) and
``rollout/server_restarts`` (restarts so far in this process).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from pipeline.rollout import RolloutError, http_json

if TYPE_CHECKING:
    from pipeline.servers import LocalRolloutCluster

PROBE_TIMEOUT_S = 30.0
"""How long ``/health`` may take (the local server runs a one-token generation when idle)."""


class ServerPoolError(RuntimeError):
    """Too few rollout servers are left (``rollout.min_servers``)."""


@dataclass
class _Server:
    url: str
    index: Optional[int]  # in the embedded cluster; None for external servers
    state: str = "serving"  # serving | pending (synced next, then admitted) | dropped
    why: str = ""


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
    restarts: int = 0
    events: int = 0
    """Drops, restarts and returns so far: a sync retried after a failure compares it."""
    _servers: list[_Server] = field(default_factory=list)
    _renewed: list[str] = field(default_factory=list)

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

    # ------------------------------------------------------------------ the loop's calls
    def members(self) -> list[str]:
        """The servers the next weight sync reaches: serving and pending ones."""
        return [s.url for s in self._servers if s.state != "dropped"]

    def check(self) -> list[str]:
        """Probe every server; drop the dead (router, sync), restart them in embedded mode,
        re-include external ones that answer again; returns :meth:`members`. Raises
        :class:`ServerPoolError` when fewer than ``min_servers`` are left."""
        for server in self._servers:
            if server.state == "dropped":
                if server.index is None and self._answers(server):
                    server.state = "pending"
                    self._renew(server)
                    self._note(f"{server.url} answers again: synced, then back in the router")
                continue
            why = self._dead(server)
            if why is None:
                continue
            server.why = why
            self.events += 1
            self._remove_from_router(server)
            if server.index is None:
                server.state = "dropped"
                self._note(f"{server.url} is gone ({why}): dropped from the router and the "
                           "weight sync")
                continue
            self._note(f"{server.url} is gone ({why}): restarting it (out of the router until "
                       "it holds the current weights)")
            try:
                self.cluster.restart_server(server.index, register=False)
            except (RolloutError, OSError) as err:
                server.state, server.why = "dropped", f"{why}; its restart failed: {err}"
                self._note(f"{server.url}: restart failed, dropped ({err})")
                continue
            self.restarts += 1
            server.state = "pending"
            self._renew(server)
        left = self.members()
        if len(left) < self.min_servers:
            dead = "; ".join(f"{s.url}: {s.why}" for s in self._servers if s.state == "dropped")
            raise ServerPoolError(
                f"only {len(left)} of {len(self._servers)} rollout servers left, "
                f"rollout.min_servers is {self.min_servers} ({dead})")
        return left

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

    def metrics(self) -> dict[str, float]:
        return {"rollout/servers_alive": float(sum(s.state == "serving" for s in self._servers)),
                "rollout/server_restarts": float(self.restarts)}

    # ------------------------------------------------------------------ helpers
    def _renew(self, server: _Server) -> None:
        self.events += 1
        if server.url not in self._renewed:
            self._renewed.append(server.url)

    def _dead(self, server: _Server) -> Optional[str]:
        """Why ``server`` counts as dead, or None."""
        if server.index is not None:
            code = self.cluster.server_exit_code(server.index)
            if code is not None:
                log = self.cluster.log_path(f"server{server.index}")
                return f"its process exited with status {code}; log {log}"
        try:
            status, _ = http_json("GET", server.url + "/health", timeout_s=self.probe_timeout_s)
        except RolloutError as err:
            return f"/health: {err.message}"
        return None if status == 200 else f"/health answered {status}"

    def _answers(self, server: _Server) -> bool:
        try:
            return http_json("GET", server.url + "/health", timeout_s=5.0)[0] == 200
        except RolloutError:
            return False

    def _remove_from_router(self, server: _Server) -> None:
        if server.index is not None:
            self.cluster.deregister(server.index)
        elif self.router_url:
            from pipeline.servers import remove_from_router

            remove_from_router(self.router_url, server.url)

    @staticmethod
    def _note(message: str) -> None:
        print(f"rollout servers: {message}", file=sys.stderr, flush=True)


def _add_to_router(router_url: str, server_url: str, timeout_s: float = 120.0) -> None:
    from pipeline.rollout import router_workers

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
