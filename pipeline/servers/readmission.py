"""The router after a weight sync: wait, bounded, until it routes to the servers again
(``rollout.router.readmit_timeout_s``).

SGLang 0.5.23's ``/health`` runs a one-token generation, which waits while the server is paused
(``pause_generation`` .. ``continue_generation``) and answers 503 after 20 s. sglang-router
0.3.2 health-checks every worker (``--health-check-interval-secs``, default 60;
``--health-check-timeout-secs`` 5; ``--health-failure-threshold`` 3 failures make it unhealthy,
``--health-success-threshold`` 2 successes healthy again), so a weight sync that pauses the
servers across a few checks makes the router mark every one unhealthy, and until its checks
re-admit them (measured: ``success threshold x interval`` after ``continue``) it answers every
request with ``503 No available workers`` (``pipeline.generation.client.no_available_workers``).
The servers are fine; only the router has not looked again yet. :class:`RouterReadmission`
(rank 0's ``pipeline.servers.pool.ServerPool`` holds one) waits for it:

* :meth:`RouterReadmission.after_sync`: after a weight sync resumed the servers, until the
  router lists every one of them healthy (polled every :data:`POLL_S`), except those that no
  longer answer (dead: the router is right, the pool's next check drops them); reported on the
  console when it has to wait, the seconds returned (``sync/router_readmit_s``); past the bound
  a :class:`RouterNotReadmitted` naming the router, the servers and what to change;
* :meth:`RouterReadmission.for_request`: a rollout request that got the 503 although its
  servers answer waits until a poll made after that answer lists a healthy worker (one thread
  polls for every waiting request), then is sent again, not counted as a failed attempt; the
  bound starts at the request's first such answer, or at the end of this process's weight-sync
  pause if that is later (``paused()``: the sync has its own bound,
  ``rollout.request_timeout_s``); reported once per episode; past it a RolloutError.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional, Sequence

from pipeline.generation.client import RolloutError, router_workers

POLL_S = 0.5
"""Between two looks at the router's workers while waiting."""
REMEDY = ("start the servers with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (their /health "
          "then answers while a weight sync pauses them; what `launch slurm` and embedded runs "
          "do), or give the router a --health-failure-threshold x --health-check-interval-secs "
          "above the longest sync pause, or raise rollout.router.readmit_timeout_s")


class RouterNotReadmitted(RolloutError):
    """The router did not route to the resumed servers again within the bound."""


class RouterReadmission:
    """Rank 0's waits for the router at ``router_url`` to route to the servers again (module
    docstring). ``paused()``: whether this process's weight sync has servers paused now;
    ``interrupted()``: whether the run is stopping (a waiting request gives up);
    ``note``: where the reports go (the console)."""

    def __init__(self, router_url: str, timeout_s: float, *,
                 paused: Callable[[], bool] = lambda: False,
                 interrupted: Optional[Callable[[], bool]] = None, poll_s: float = POLL_S,
                 note: Optional[Callable[[str], None]] = None):
        if not timeout_s > 0:
            raise ValueError(f"readmit_timeout_s: must be > 0, got {timeout_s}")
        self.router_url = router_url.rstrip("/")
        self.timeout_s = timeout_s
        self.paused = paused
        self.interrupted = interrupted or (lambda: False)
        """True once the run is asked to stop: a wait gives up at once."""
        self.poll_s = poll_s
        self.note = note or _console
        self.request_waits = 0
        """Episodes so far in which rollout requests waited for the router."""
        self._lock = threading.Lock()
        self._healthy_at = float("-inf")  # monotonic: the last poll that listed a healthy worker
        self._polled_at = float("-inf")
        self._episode: Optional[float] = None  # when the current requests' wait began
        self._pause_ended = float("-inf")

    # ------------------------------------------------------------------ after a sync
    def after_sync(self, server_urls: Sequence[str],
                   alive: Callable[[str], bool] = lambda url: True) -> float:
        """Wait until the router lists every server of ``server_urls`` that it lists at all as
        healthy, except those that do not answer (``alive(url)`` false: dead, the pool's next
        check drops them; the router is right about them); returns the seconds waited (0.0 when
        it did at once). RouterNotReadmitted after ``timeout_s``."""
        urls = {u.rstrip("/") for u in server_urls}
        start = time.monotonic()
        said = False
        while True:
            listed = self._unhealthy(urls)
            dead = [u for u in listed if u in urls and not alive(u)]
            if dead:
                urls -= set(dead)
                self.note(f"weight sync: {', '.join(dead)} does not answer: not waiting for the "
                          f"router {self.router_url} to re-admit it (the next check of the "
                          "servers drops it)")
            unhealthy = [u for u in listed if u not in dead]
            if not unhealthy:
                break
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                raise RouterNotReadmitted(
                    self.router_url + "/workers", 200,
                    f"the router still lists {', '.join(unhealthy)} unhealthy {waited:.0f} s "
                    "after the weight sync resumed them (rollout.router.readmit_timeout_s "
                    f"{self.timeout_s:g}): its health checks marked them unhealthy during the "
                    f"sync's pause and have not re-admitted them; {REMEDY}")
            if not said:
                said = True
                self.note(f"weight sync: the router {self.router_url} marked "
                          f"{', '.join(unhealthy)} unhealthy during the pause; waiting for its "
                          f"health checks to re-admit them (at most {self.timeout_s:.0f} s, "
                          "rollout.router.readmit_timeout_s)")
            time.sleep(self.poll_s)
        waited = time.monotonic() - start
        if said:
            self.note(f"weight sync: the router routes to every server again after "
                      f"{waited:.1f} s")
        return waited if said else 0.0

    def _unhealthy(self, urls: set[str]) -> list[str]:
        try:
            workers = router_workers(self.router_url)
        except RolloutError:
            return [f"(router {self.router_url} did not answer)"]
        return sorted(w["url"].rstrip("/") for w in workers
                      if w["url"].rstrip("/") in urls and not w.get("is_healthy"))

    # ------------------------------------------------------------------ a request's 503
    def for_request(self, answered_at: float, first_at: float) -> None:
        """Blocking (run it on a thread): return once a poll of the router made after
        ``answered_at`` (``time.monotonic()`` when the request got the 503) lists a healthy
        worker. A RolloutError after ``timeout_s`` from ``first_at`` (the request's first such
        answer) or from the end of the weight sync's pause, whichever is later."""
        with self._lock:
            while self._healthy_at <= answered_at:
                now = time.monotonic()
                if self.paused():
                    self._pause_ended = now
                if now - max(first_at, self._pause_ended) > self.timeout_s:
                    raise RouterNotReadmitted(self.router_url + "/generate", 503,
                                              self._gave_up())
                if self.interrupted():
                    raise RouterNotReadmitted(self.router_url + "/generate", 503,
                                              "stopped (a stop signal) while waiting for the "
                                              "router to route to its servers again")
                if self._episode is None:
                    self._episode = now
                    self.request_waits += 1
                    self.note(f"rollout: the router {self.router_url} answers 503 No available "
                              "workers although its servers answer (its health checks marked "
                              "them unhealthy, e.g. during a weight sync's pause): requests "
                              f"wait for it to route to them again (at most "
                              f"{self.timeout_s:.0f} s, rollout.router.readmit_timeout_s)")
                time.sleep(max(0.0, self._polled_at + self.poll_s - now))
                self._poll()
            if self._episode is not None:
                self.note(f"rollout: the router {self.router_url} routes again after "
                          f"{time.monotonic() - self._episode:.1f} s")
                self._episode = None

    def _poll(self) -> None:
        self._polled_at = time.monotonic()
        try:
            workers = router_workers(self.router_url)
        except RolloutError:
            return  # the router itself did not answer: the next poll, within the bound
        if any(w.get("is_healthy") for w in workers):
            self._healthy_at = self._polled_at

    def _gave_up(self) -> str:
        try:
            listed = ", ".join(f"{w['url']} ({'healthy' if w.get('is_healthy') else 'unhealthy'})"
                               for w in router_workers(self.router_url)) or "none"
        except RolloutError as err:
            listed = f"unknown ({err.message})"
        return (f"the router answered 503 No available workers for {self.timeout_s:g} s "
                "(rollout.router.readmit_timeout_s) although its servers answer; its workers: "
                f"{listed}; {REMEDY}")


def _console(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
