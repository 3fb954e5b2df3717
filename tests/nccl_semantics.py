"""NCCL's asynchrony on gloo, for the CPU tests: collectives return before the data has moved.

On a GPU, ``dist.broadcast(t)`` (and ``work.wait()``) only ORDER the CUDA stream: the host goes
on at once, and the data moves later, on NCCL's stream; a later kernel that reads ``t`` waits for
it, a host thread that sends an HTTP request does not. Gloo, which the CPU tests run on, blocks
the host until the data has moved, so every host-side ordering assumption ("after ``wait()`` the
servers have the bucket") holds on the CPU and fails on a GPU. Inside ``NcclSemantics()``:

* every tensor collective and point-to-point call of every ``ProcessGroup`` (``broadcast``,
  ``allreduce``, ``allgather``, ``_allgather_base``, ``reduce_scatter``, ``_reduce_scatter_base``,
  ``allreduce_coalesced``, ``alltoall_base``, ``send``, ``recv``) is issued to gloo as it is (so
  the order of the collectives stays the order of the calls, as on one stream), but the work it
  returns has a ``wait()`` that returns at once; the data moves on gloo's own threads,
  ``delay_s`` later at the earliest (``delay_s``: how far the "stream" lags the host);
* the tensors such a call touches are pending until their gloo work is done, and any torch
  operation of this thread that reads or writes a pending tensor (``.item()``, ``.clone()``, an
  add, a copy into it) first waits for it: what stream order gives a kernel on a GPU;
* ``synchronize()`` waits for everything (``torch.cuda.synchronize()``).

So code is correct under it exactly when it is correct under NCCL's rule: the device side
ordered, the host side not. ``CALLS`` counts the deferred calls per method (a test can check that
the collectives it meant to defer were).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

METHODS = ("broadcast", "allreduce", "allgather", "_allgather_base", "reduce_scatter",
           "_reduce_scatter_base", "allreduce_coalesced", "alltoall_base", "send", "recv")


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return id(t)


class _DeferredWork:
    """What the collective returns: ``wait()`` orders (returns at once), nothing blocks."""

    def __init__(self, real, semantics: "NcclSemantics"):
        self._real, self._semantics = real, semantics

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - NCCL: the host does not block
        return True

    def is_completed(self) -> bool:
        return self._real.is_completed()

    def is_success(self) -> bool:
        return self._real.is_success()

    def exception(self):
        return self._real.exception()

    def source_rank(self) -> int:
        self._semantics._settle(self._real)  # the host reads the result: that synchronizes
        return self._real.source_rank()

    def result(self):
        self._semantics._settle(self._real)
        return self._real.result()

    def get_future(self):
        return self._real.get_future()

    def synchronize(self) -> None:
        pass


class _Gate(TorchFunctionMode):
    """Before a torch operation touches a pending tensor, wait for its collective."""

    def __init__(self, semantics: "NcclSemantics"):
        super().__init__()
        self._semantics = semantics

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._semantics._pending and not getattr(func, "__module__", "").startswith(
                "torch.distributed"):
            self._semantics._settle_tensors(_tensors(args) + _tensors(kwargs))
        return func(*args, **kwargs)


class NcclSemantics:
    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.calls: collections.Counter = collections.Counter()
        self._pending: dict[int, list] = {}  # storage -> [(real work, issued at)]
        self._lock = threading.Lock()
        self._originals: dict[str, Any] = {}
        self._gate = _Gate(self)

    # ---------------------------------------------------------------- waiting
    def _settle(self, real) -> None:
        with self._lock:
            issued = next((at for works in self._pending.values() for w, at in works if w is real),
                          None)
        if issued is not None and self.delay_s:
            time.sleep(max(0.0, issued + self.delay_s - time.monotonic()))
        real.wait()
        with self._lock:
            for key in list(self._pending):
                self._pending[key] = [(w, at) for w, at in self._pending[key] if w is not real]
                if not self._pending[key]:
                    del self._pending[key]

    def _settle_tensors(self, tensors) -> None:
        keys = {_key(t) for t in tensors}
        with self._lock:
            works = [w for k in keys & self._pending.keys() for w, _ in self._pending[k]]
        for work in works:
            self._settle(work)

    def synchronize(self) -> None:
        with self._lock:
            works = [w for ws in self._pending.values() for w, _ in ws]
        for work in works:
            self._settle(work)

    # ---------------------------------------------------------------- install
    def _wrap(self, name: str):
        original = self._originals[name]
        semantics = self

        def deferred(pg, *args, **kwargs):
            real = original(pg, *args, **kwargs)
            tensors = _tensors(args)
            with semantics._lock:
                semantics.calls[name] += 1
                now = time.monotonic()
                for t in tensors:
                    semantics._pending.setdefault(_key(t), []).append((real, now))
            return _DeferredWork(real, semantics)

        return deferred

    def __enter__(self) -> "NcclSemantics":
        for name in METHODS:
            self._originals[name] = getattr(dist.ProcessGroup, name)
            setattr(dist.ProcessGroup, name, self._wrap(name))
        self._gate.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.synchronize()
        finally:
            self._gate.__exit__(*exc)
            for name, original in self._originals.items():
                setattr(dist.ProcessGroup, name, original)
