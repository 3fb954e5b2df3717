"""Calls in both directions over the producer's pipe (:class:`Endpoint`): each side asks the other
by name and waits for the answer, serves the other side's calls, and sends one-way notes.

    rank 0 -> producer   the batch source's methods (``restore``, ``start``, ``next``, ...):
                         served one at a time, in order, on the producer's main thread
    producer -> rank 0   the server pool's hooks of the rollout client (``wait_for_live``,
                         ``wait_for_router``): each served on a thread of its own, as the
                         client's executor threads called them in one process
    notes                ``interrupt`` (rank 0 got a stop signal), ``requests_retried``

Messages (:mod:`pipeline.producer.wire`)::

    ("call", id, name, args)   ("reply", id, True, value)   ("reply", id, False, Failure)
    ("note", name, args)

An error raised by a call crosses as :class:`megatron_gspo.collectives.Failure`: the same
exception type on the other side when it pickles (a ``RolloutError`` naming its server), else a
``RemoteError`` with its type's name and message. When the other side is gone (its process
ended, the pipe closed), every call waiting for it and every later one raises
:class:`PeerGone`, whose message says what the caller was waiting for.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any, Optional

from megatron_gspo.collectives import Failure
from pipeline.producer.wire import Channel

POLL_S = 0.2
"""How often the reader wakes when nothing arrives (``on_idle``)."""


class PeerGone(RuntimeError):
    """The other side of the pipe ended (its process exited or was killed)."""


class Endpoint:
    """One side of the pipe; see the module docstring.

    ``handlers``: name -> function of the calls this side serves; ``serial``: serve them one at a
    time in arrival order on the thread that runs :meth:`serve` (else each on a thread of its
    own, started by the reader); ``notes``: name -> function of the notes it takes (run on the
    reader thread: keep them short); ``on_idle``: called by the reader every :data:`POLL_S`;
    ``describe_gone``: the words :class:`PeerGone` uses for the other side's end."""

    def __init__(self, channel: Channel, *, handlers: Optional[dict[str, Callable]] = None,
                 serial: bool = False, notes: Optional[dict[str, Callable]] = None,
                 on_idle: Optional[Callable[[], None]] = None,
                 describe_gone: Callable[[], str] = lambda: "the other process ended"):
        self._channel = channel
        self._handlers = dict(handlers or {})
        self._serial = serial
        self._notes = dict(notes or {})
        self._on_idle = on_idle
        self._describe_gone = describe_gone
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, "queue.SimpleQueue"] = {}
        self._inbox: "queue.SimpleQueue" = queue.SimpleQueue()  # serial calls, then None at EOF
        self._gone: Optional[str] = None
        self._reader: Optional[threading.Thread] = None

    # --- the reader
    def start(self) -> "Endpoint":
        self._reader = threading.Thread(target=self._read, daemon=True, name="producer pipe")
        self._reader.start()
        return self

    def _read(self) -> None:
        try:
            while True:
                if not self._channel.poll(POLL_S):
                    if self._on_idle is not None:
                        self._on_idle()
                    continue
                self._dispatch(self._channel.recv())
        except (EOFError, OSError):
            pass
        finally:
            self._end(self._describe_gone())

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                box = self._waiting.pop(call_id, None)
            if box is not None:
                box.put((ok, value))
        elif kind == "call":
            if self._serial:
                self._inbox.put(message)
            else:
                threading.Thread(target=self._answer, args=(message,), daemon=True,
                                 name=f"producer call {message[2]}").start()
        elif kind == "note":
            _, name, args = message
            if name in self._notes:
                self._notes[name](*args)

    def _end(self, why: str) -> None:
        with self._lock:
            self._gone = self._gone or why
            waiting, self._waiting = self._waiting, {}
        for box in waiting.values():
            box.put((False, None))
        self._inbox.put(None)

    # --- serving the other side's calls
    def _answer(self, message: tuple) -> None:
        _, call_id, name, args = message
        try:
            handler = self._handlers.get(name)
            if handler is None:
                raise ValueError(f"no call named {name!r} here (known: {sorted(self._handlers)})")
            reply = ("reply", call_id, True, handler(*args))
        except Exception as err:  # noqa: BLE001 - raised again on the calling side
            reply = ("reply", call_id, False, Failure.of(err))
        try:
            self._channel.send(reply)
        except (OSError, ValueError):  # the other side is gone: nobody waits for it
            pass

    def serve(self, stop_after: tuple[str, ...] = ()) -> None:
        """(``serial``) Serve the calls in order on this thread until the pipe ends or a call
        named in ``stop_after`` has been answered."""
        while True:
            message = self._inbox.get()
            if message is None:
                return
            self._answer(message)
            if message[2] in stop_after:
                return

    # --- calling the other side
    def call(self, name: str, *args: Any) -> Any:
        """The other side's ``name(*args)``: its value, or its error raised here; blocks until it
        answers (the other side bounds its own work) or is gone (:class:`PeerGone`)."""
        box: "queue.SimpleQueue" = queue.SimpleQueue()
        with self._lock:
            if self._gone is not None:
                raise PeerGone(f"{self._gone} (before {name})")
            call_id = next(self._ids)
            self._waiting[call_id] = box
        try:
            self._channel.send(("call", call_id, name, args))
        except (OSError, ValueError) as err:
            with self._lock:
                self._waiting.pop(call_id, None)
            raise PeerGone(f"{self._describe_gone()} (sending {name}: {err})") from None
        ok, value = box.get()
        if ok:
            return value
        if value is None:
            raise PeerGone(f"{self._gone} (while waiting for {name})")
        raise value.error()

    def note(self, name: str, *args: Any) -> None:
        """A one-way message (dropped when the other side is gone)."""
        try:
            self._channel.send(("note", name, args))
        except (OSError, ValueError):
            pass

    @property
    def gone(self) -> Optional[str]:
        """Why the other side is gone (None while it is there)."""
        return self._gone

    def close(self) -> None:
        self._channel.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5.0)
