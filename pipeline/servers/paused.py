"""Which rollout servers this process's weight sync has paused right now (rank 0).

The pusher (``pipeline.weights.push.WeightPusher``) adds every server before its
``/pause_generation`` and removes it once ``/continue_generation`` answered (or recovery tried
it). The server pool (``pipeline.servers.pool.ServerPool``) reads it: a server paused by the
sync is alive if its HTTP process answers (``/model_info``), because SGLang's ``/health``
generates a token, which waits while paused, and answers 503 after 20 s; and a rollout request
waiting for the router to route again does not count the pause against its bound
(``pipeline.servers.readmission``)."""

from __future__ import annotations

import threading
from typing import Iterable


class PausedServers:
    """A thread-safe set of server URLs (without a trailing slash)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._urls: set[str] = set()

    def add(self, urls: Iterable[str]) -> None:
        with self._lock:
            self._urls.update(u.rstrip("/") for u in urls)

    def discard(self, urls: Iterable[str]) -> None:
        with self._lock:
            self._urls.difference_update(u.rstrip("/") for u in urls)

    def __contains__(self, url: str) -> bool:
        with self._lock:
            return url.rstrip("/") in self._urls

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._urls)
