"""The pipe between rank 0 and its rollout producer process: messages with tensors out of band.

A message is any picklable object; its tensors (a batch: token ids, log-probs, advantages, the
routed experts of routing replay) do not go through the pickle stream. Each is sent as its raw
bytes in a frame of its own (pickle protocol 5's out-of-band buffers) and read back into a
``bytearray`` that the received tensor then uses as its memory: one copy through the pipe, no
parsing, no per-element Python work, whatever the dtype (bfloat16 included: its bytes are sent).
Torch's own multiprocessing pickling (shared memory handed over by a socket that checks the
multiprocessing authentication key) does not work between two processes that did not start one
another through ``multiprocessing``; this needs only the pipe.

Frames of one message, each a ``multiprocessing.connection`` frame::

    pickle([size of each tensor buffer])   pickle(message, buffers out of band)   buffer ...

:class:`Channel` sends whole messages under a lock (any thread) and receives them on one thread.
"""

from __future__ import annotations

import io
import pickle
import threading
from multiprocessing.connection import Connection
from typing import Any

import torch

__all__ = ["Channel", "dumps", "loads"]


class _Pickler(pickle.Pickler):
    """Protocol 5, every tensor's bytes as an out-of-band buffer."""

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach().to("cpu").contiguous()
        shape = tuple(t.shape)
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return _tensor_from, (pickle.PickleBuffer(raw), str(t.dtype).removeprefix("torch."),
                              shape)


def _tensor_from(buffer: Any, dtype: str, shape: tuple) -> torch.Tensor:
    """A tensor over ``buffer`` (its raw bytes; kept alive by the tensor)."""
    kind = getattr(torch, dtype)
    if len(memoryview(buffer)) == 0:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(kind).reshape(shape)


def dumps(message: Any) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """``message`` -> (its pickle, the raw buffers of its tensors, in order)."""
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(message)
    return out.getvalue(), buffers


def loads(data: bytes, buffers: list) -> Any:
    """The message of :func:`dumps`' output (``buffers``: writable copies of its buffers)."""
    return pickle.loads(data, buffers=buffers)


class Channel:
    """Messages over a pair of one-way pipes (``inbox`` read, ``outbox`` written)."""

    def __init__(self, inbox: Connection, outbox: Connection):
        self.inbox, self.outbox = inbox, outbox
        self._send_lock = threading.Lock()

    def send(self, message: Any) -> None:
        """Any thread; a whole message at a time."""
        data, buffers = dumps(message)
        sizes = [len(b.raw()) for b in buffers]
        with self._send_lock:
            self.outbox.send_bytes(pickle.dumps(sizes))
            self.outbox.send_bytes(data)
            for b in buffers:
                if len(b.raw()):
                    self.outbox.send_bytes(b.raw())

    def poll(self, timeout_s: float) -> bool:
        return self.inbox.poll(timeout_s)

    def recv(self) -> Any:
        """One thread only. EOFError / OSError when the other side is gone."""
        sizes = pickle.loads(self.inbox.recv_bytes())
        data = self.inbox.recv_bytes()
        buffers = []
        for size in sizes:
            buf = bytearray(size)
            if size:
                self.inbox.recv_bytes_into(buf)
            buffers.append(buf)
        return loads(data, buffers)

    def close(self) -> None:
        for conn in (self.inbox, self.outbox):
            try:
                conn.close()
            except OSError:
                pass
