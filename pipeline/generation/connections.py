"""The rollout client's HTTP connections: one bounded pool, and a lack of file descriptors named
as such.

**One pool.** Every call of a :class:`~pipeline.generation.client.RolloutClient` (each
``generate_groups`` of an asynchronous rollout's many groups, the multi-turn sessions, the
aborts) shares one :class:`ConnectionPool`: one aiohttp session per event loop, opened by the
first call that needs it and closed when the last one ends. At most ``limit`` ``/generate``
requests of the pool are on the wire at once (the others wait for a slot before their timeout
starts), over at most ``limit + CONTROL_CONNECTIONS`` sockets (the extra ones keep aborts
possible while every slot is taken); idle keep-alive connections close after aiohttp's 15 s.
Without a pool, each call opened a session of its own (aiohttp's 100 connections each): a
rollout of many groups at once reached the process's ``RLIMIT_NOFILE``.

The limit (``RolloutClient(max_connections=...)``): by default :func:`default_limit`, a quarter
of the process's soft ``RLIMIT_NOFILE``, at most :data:`DEFAULT_MAX_CONNECTIONS` (the trainer's
other files, sockets and pipes keep the rest).

**Out of file descriptors** (``EMFILE`` / ``ENFILE``): not a dead server. :func:`out_of_files`
recognises it in an error (aiohttp wraps it in ``ClientConnectorError``, urllib in ``URLError``);
the client raises :class:`TooManyOpenFiles` at once, naming the errno, the limit and what holds
the descriptors, instead of retrying and then waiting for a live server.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import threading
from dataclasses import dataclass
from typing import Optional

import aiohttp

DEFAULT_MAX_CONNECTIONS = 512
"""The default limit's ceiling: ``/generate`` requests of one client on the wire at once."""
CONTROL_CONNECTIONS = 16
"""Sockets the pool keeps beyond its ``/generate`` limit, for the aborts."""
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def nofile_limits() -> tuple[int, int]:
    """(soft, hard) ``RLIMIT_NOFILE`` of this process."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def default_limit() -> int:
    """A quarter of the soft ``RLIMIT_NOFILE`` (at least 4), at most
    :data:`DEFAULT_MAX_CONNECTIONS`."""
    soft, _ = nofile_limits()
    if soft == resource.RLIM_INFINITY:
        return DEFAULT_MAX_CONNECTIONS
    return max(4, min(DEFAULT_MAX_CONNECTIONS, soft // 4))


def out_of_files(err: Optional[BaseException]) -> bool:
    """Whether ``err`` (or an error in its chain, or aiohttp's / urllib's wrapped ``os_error`` /
    ``reason``) is EMFILE / ENFILE: this process (or the system) has no file descriptor left."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in OUT_OF_FILES:
            return True
        inner = getattr(err, "os_error", None) or getattr(err, "reason", None)
        if isinstance(inner, OSError) and inner.errno in OUT_OF_FILES:
            return True
        err = err.__cause__ or err.__context__
    return False


def _open_descriptors() -> str:
    try:
        return str(len(os.listdir("/proc/self/fd")))
    except OSError:  # listing needs a descriptor too
        return "all"


class TooManyOpenFiles(OSError):
    """This process ran out of file descriptors talking to a rollout server (errno EMFILE or
    ENFILE): not a server failure; the message names the limit and the client's share of it."""

    def __init__(self, message: str, code: int = errno.EMFILE):
        super().__init__(code, message)

    def __reduce__(self):  # it crosses ranks as itself (megatron_gspo.collectives)
        return type(self), (self.strerror, self.errno), self.__dict__

    @classmethod
    def calling(cls, url: str, err: BaseException, limit: Optional[int]) -> "TooManyOpenFiles":
        code = next((e.errno for e in (err, getattr(err, "os_error", None),
                                       getattr(err, "reason", None))
                     if isinstance(e, OSError) and e.errno in OUT_OF_FILES), errno.EMFILE)
        soft, hard = nofile_limits()
        share = (f"the rollout client keeps at most {limit} /generate connections (+"
                 f"{CONTROL_CONNECTIONS} for aborts)" if limit is not None else
                 "a control call of the rollout client")
        return cls(f"rollout client: out of file descriptors calling {url} "
                   f"({errno.errorcode[code]}: {os.strerror(code)}; {_open_descriptors()} open, "
                   f"RLIMIT_NOFILE soft {soft}, hard {hard}): this process, not the server; "
                   f"{share}; raise the limit (ulimit -n, up to the hard limit) or find what "
                   "else holds descriptors (ls /proc/<pid>/fd)", code)


@dataclass
class Pooled:
    """The pool of the running event loop: its session, and the slots of ``/generate``
    requests on the wire."""

    session: aiohttp.ClientSession
    slots: asyncio.Semaphore
    users: int = 0


class ConnectionPool:
    """One aiohttp session per event loop, shared by every call that holds it (see the module
    docstring); ``limit``: ``/generate`` requests on the wire at once."""

    def __init__(self, limit: Optional[int] = None):
        self.limit = int(limit) if limit is not None else default_limit()
        if self.limit < 1:
            raise ValueError(f"max_connections: must be >= 1, got {limit}")
        self._loops: dict[asyncio.AbstractEventLoop, Pooled] = {}
        self._lock = threading.Lock()  # calls on several threads' loops at once

    @contextlib.asynccontextmanager
    async def use(self):
        """``async with pool.use() as pooled``: the running loop's :class:`Pooled`, opened if
        none is; closed when its last user leaves."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pooled = self._loops.get(loop)
            if pooled is None:
                connector = aiohttp.TCPConnector(limit=self.limit + CONTROL_CONNECTIONS,
                                                 limit_per_host=0)
                pooled = self._loops[loop] = Pooled(aiohttp.ClientSession(connector=connector),
                                                    asyncio.Semaphore(self.limit))
            pooled.users += 1
        try:
            yield pooled
        finally:
            with self._lock:
                pooled.users -= 1
                last = pooled.users == 0
                if last:
                    del self._loops[loop]
            if last:
                await pooled.session.close()
