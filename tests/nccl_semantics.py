"""NCCL's asynchrony on gloo, for the CPU tests: collectives return before the data has moved.

On a GPU, ``dist.broadcast(t)`` (and ``work.wait()``) only ORDER the CUDA stream: the host goes
on at once and the data moves later, on the communicator's own stream; a later kernel that reads
``t`` waits for it, a host thread that sends an HTTP request does not. Gloo, which the CPU tests
run on, blocks the host until the data has moved, so every host-side ordering assumption ("after
``wait()`` the servers have the bucket") holds on the CPU and fails on a GPU. Inside
``NcclSemantics(delay_s)``, in the process that entered it:

* every tensor collective and point-to-point method of ``torch.distributed.ProcessGroup`` that
  torch 2.13's ``distributed_c10d`` calls (``broadcast``, ``allreduce``, ``allreduce_coalesced``,
  ``reduce``, ``allgather``, ``all_gather_single`` - what ``all_gather_into_tensor`` calls -,
  ``allgather_coalesced``, ``all_gather_single_coalesced``, ``reduce_scatter``,
  ``reduce_scatter_single`` - ``reduce_scatter_tensor`` -, ``reduce_scatter_single_coalesced``,
  ``alltoall``, ``all_to_all_single``, ``gather``, ``scatter``, ``send``, ``recv``,
  ``recv_anysource``, the legacy ``_allgather_base`` / ``_reduce_scatter_base`` /
  ``alltoall_base`` / ``*_tensor_coalesced``, and ``_start_coalescing`` / ``_end_coalescing``)
  returns at once a work whose ``wait()`` returns at once too. The call goes on the group's
  **stream**: a thread of that group that issues its calls to gloo in call order (so every rank
  issues a group's collectives in the same order, as on one NCCL stream), each ``delay_s`` after
  the host made it at the earliest (how far the device lags the host);
* a call waits (on its stream, never on the host) for the earlier calls of its group that touch
  the same tensor storage (stream order), and for every call whose work the host had
  ``wait()``-ed before making it, on any group (``wait()`` makes the current stream wait for the
  communicator's; a later collective is issued after it on the current stream);
* the tensors a call touches are pending until its gloo work is done, and any torch operation
  that reads or writes a pending tensor first waits for it, on the thread that entered and on
  every thread started inside the context (a ``TorchDispatchMode`` sees every aten operation,
  including the C++ backward formulas; a ``TorchFunctionMode`` sees the Python-level reads that
  run no aten operation, such as ``.numpy()`` and ``.tolist()``): what stream order gives a kernel
  on a GPU;
* ``barrier`` and ``monitored_barrier`` block the host until the group's stream has drained and
  the barrier is done (NCCL's barrier synchronizes the device); ``source_rank()`` of a receive,
  ``result()`` and ``synchronize()`` of a work wait for it;
* :meth:`NcclSemantics.synchronize` waits for every call (``torch.cuda.synchronize()``); leaving
  the context does it too, and re-raises the first error a stream met.

``host_groups``: groups that stay as they are (the ``cpu:gloo`` half of a ``cpu:gloo,cuda:nccl``
layout, such as the pusher's control group: gloo on CPU tensors blocks the host on a GPU
machine too). So code is correct under it exactly when it is correct under NCCL's rule: the
device side ordered, the host side not. ``calls`` counts the deferred calls per method (a test
checks that the collectives it meant to defer were).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

DEFERRED = ("broadcast", "allreduce", "allreduce_coalesced", "reduce", "allgather",
            "all_gather_single", "_allgather_base", "allgather_coalesced",
            "allgather_into_tensor_coalesced", "all_gather_single_coalesced", "reduce_scatter",
            "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
            "reduce_scatter_single_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
            "gather", "scatter", "send", "recv", "recv_anysource", "_start_coalescing",
            "_end_coalescing")
HOST_BLOCKING = ("barrier", "monitored_barrier")
_INTERNAL = "_nccl_semantics_internal"  # marks the streams' own threads (never gated)


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
        return t.untyped_storage().data_ptr() or id(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return id(t)


class _Call:
    """One deferred call: what it touches, what it waits for, when it is done."""

    def __init__(self, name: str, pg, args, kwargs, deps: list["_Call"], issued: float):
        self.name, self.pg, self.args, self.kwargs = name, pg, args, kwargs
        self.keys = {_key(t) for t in _tensors(args) + _tensors(kwargs)}
        self.deps, self.issued = deps, issued
        self.real = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        self.future: torch.futures.Future = torch.futures.Future()

    def join(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"NcclSemantics: {self.name} failed on its stream: "
                               f"{type(self.error).__name__}: {self.error}") from self.error


class _DeferredWork:
    """What a deferred call returns: ``wait()`` orders (returns at once), nothing blocks."""

    def __init__(self, call: _Call, semantics: "NcclSemantics"):
        self._call, self._semantics = call, semantics

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - NCCL: the host does not block
        self._semantics._waited(self._call)
        return True

    def is_completed(self) -> bool:
        return self._call.done.is_set()

    def is_success(self) -> bool:
        return self._call.done.is_set() and self._call.error is None

    def exception(self):
        return self._call.error

    def source_rank(self) -> int:
        self._call.join()  # the host reads the result: that synchronizes
        return self._call.real.source_rank()

    _source_rank = source_rank

    def result(self):
        self._call.join()
        return self._call.real.result()

    def get_future(self) -> torch.futures.Future:
        return self._call.future

    def synchronize(self) -> None:
        self._call.join()


class _Stream:
    """A group's stream: issues its calls to gloo in order, then waits for them in order."""

    def __init__(self, semantics: "NcclSemantics", pg):
        self._semantics = semantics
        self.issue_q: queue.Queue = queue.Queue()
        self.done_q: queue.Queue = queue.Queue()
        self.calls: list[_Call] = []  # not done yet, in order
        self.threads = []
        for target, name in ((self._issue, "issue"), (self._complete, "complete")):
            thread = threading.Thread(target=target, daemon=True,
                                      name=f"nccl-semantics-{name}-{id(pg):x}")
            setattr(thread, _INTERNAL, True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        """Stop both threads (after the calls queued before)."""
        self.issue_q.put(None)
        for thread in self.threads:
            thread.join()

    def _issue(self) -> None:
        while True:
            call = self.issue_q.get()
            if call is None:
                self.done_q.put(None)
                return
            lag = call.issued + self._semantics.delay_s - time.monotonic()
            if lag > 0:
                time.sleep(lag)
            for dep in call.deps:
                dep.done.wait()
            try:
                call.real = self._semantics._originals[call.name](call.pg, *call.args,
                                                                 **call.kwargs)
            except BaseException as err:  # noqa: BLE001 - reported where the host syncs
                call.error = err
            self.done_q.put(call)

    def _complete(self) -> None:
        while True:
            call = self.done_q.get()
            if call is None:
                return
            try:
                if call.error is None and call.real is not None:
                    call.real.wait()
            except BaseException as err:  # noqa: BLE001
                call.error = err
            self._semantics._finished(self, call)


class _DispatchGate(TorchDispatchMode):
    """Before an aten operation touches a pending tensor, wait for its calls."""

    def __init__(self, semantics: "NcclSemantics"):
        super().__init__()
        self._semantics = semantics

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._semantics._pending and func.namespace not in ("c10d", "_c10d_functional"):
            self._semantics._settle_tensors(_tensors(args) + _tensors(kwargs))
        return func(*args, **kwargs)


_HOST_READS = {"numpy", "tolist", "__array__", "__dlpack__", "data_ptr", "item"}


class _FunctionGate(TorchFunctionMode):
    """Reads by the host that run no aten operation (``.numpy()``, ``.tolist()``, ...)."""

    def __init__(self, semantics: "NcclSemantics"):
        super().__init__()
        self._semantics = semantics

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._semantics._pending and getattr(func, "__name__", "") in _HOST_READS:
            self._semantics._settle_tensors(_tensors(args))
        return func(*args, **kwargs)


class NcclSemantics:
    """See the module docstring."""

    def __init__(self, delay_s: float = 0.0, host_groups: Iterable[Any] = ()):
        self.delay_s = delay_s
        self.host_groups = list(host_groups)
        self.calls: collections.Counter = collections.Counter()
        self._pending: dict[int, list[_Call]] = {}  # storage -> its calls not done yet
        self._waited_calls: list[_Call] = []  # wait()-ed, not done: later calls wait for them
        self._streams: dict[int, _Stream] = {}
        self._errors: list[str] = []
        self._lock = threading.Lock()
        self._originals: dict[str, Any] = {}  # name -> the method (called with the group first)
        self._saved: dict[str, Any] = {}  # name -> the class attribute itself (restored as is)
        self._thread_run = None
        self._gates: list = []

    # ---------------------------------------------------------------- bookkeeping
    def _waited(self, call: _Call) -> None:
        with self._lock:
            if not call.done.is_set():
                self._waited_calls.append(call)

    def _finished(self, stream: _Stream, call: _Call) -> None:
        with self._lock:
            for key in call.keys:
                calls = [c for c in self._pending.get(key, []) if c is not call]
                if calls:
                    self._pending[key] = calls
                else:
                    self._pending.pop(key, None)
            stream.calls = [c for c in stream.calls if c is not call]
            self._waited_calls = [c for c in self._waited_calls if c is not call]
            if call.error is not None:
                self._errors.append(f"{call.name}: {type(call.error).__name__}: {call.error}")
        call.done.set()
        if call.error is None:
            call.future.set_result(_tensors(call.args))
        else:
            call.future.set_exception(call.error)

    def _settle_tensors(self, tensors) -> None:
        keys = {_key(t) for t in tensors}
        with self._lock:
            calls = [c for k in keys & self._pending.keys() for c in self._pending[k]]
        for call in calls:
            call.join()

    def synchronize(self) -> None:
        """Wait for every deferred call (the device drained)."""
        with self._lock:
            calls = [c for s in self._streams.values() for c in s.calls]
        for call in calls:
            call.done.wait()

    # ---------------------------------------------------------------- the patched methods
    def _defer(self, name: str):
        semantics = self

        def deferred(pg, *args, **kwargs):
            if any(pg is g for g in semantics.host_groups):
                return semantics._originals[name](pg, *args, **kwargs)
            with semantics._lock:
                stream = semantics._streams.get(id(pg))
                if stream is None:
                    stream = semantics._streams[id(pg)] = _Stream(semantics, pg)
                semantics.calls[name] += 1
                call = _Call(name, pg, args, kwargs, [], time.monotonic())
                call.deps = [c for c in semantics._waited_calls if c.pg is not pg] + \
                    [c for c in stream.calls if c.keys & call.keys]
                stream.calls.append(call)
                for key in call.keys:
                    semantics._pending.setdefault(key, []).append(call)
                stream.issue_q.put(call)
            return _DeferredWork(call, semantics)

        deferred.__name__ = name
        return deferred

    def _blocking(self, name: str):
        semantics = self

        def blocking(pg, *args, **kwargs):
            with semantics._lock:
                stream = semantics._streams.get(id(pg))
                calls = list(stream.calls) if stream is not None else []
                semantics.calls[name] += 1
            for call in calls:
                call.join()
            work = semantics._originals[name](pg, *args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()
            return work

        blocking.__name__ = name
        return blocking

    # ---------------------------------------------------------------- install
    def _enter_gates(self) -> list:
        gates = [_DispatchGate(self), _FunctionGate(self)]
        for gate in gates:
            gate.__enter__()
        return gates

    def __enter__(self) -> "NcclSemantics":
        for name in DEFERRED + HOST_BLOCKING:
            if hasattr(dist.ProcessGroup, name):
                # pybind11 keeps methods as instancemethod descriptors in the class __dict__;
                # getattr gives the bare builtin, which would not bind ``self`` if set back.
                self._saved[name] = dist.ProcessGroup.__dict__.get(name)
                self._originals[name] = getattr(dist.ProcessGroup, name)
                setattr(dist.ProcessGroup, name,
                        self._defer(name) if name in DEFERRED else self._blocking(name))
        original_run = self._thread_run = threading.Thread.run
        semantics = self

        def gated_run(thread):
            if getattr(thread, _INTERNAL, False):
                return original_run(thread)
            gates = semantics._enter_gates()
            try:
                return original_run(thread)
            finally:
                for gate in reversed(gates):
                    gate.__exit__(None, None, None)

        threading.Thread.run = gated_run
        self._gates = self._enter_gates()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.synchronize()
        finally:
            for gate in reversed(self._gates):
                gate.__exit__(None, None, None)
            threading.Thread.run = self._thread_run
            for name, saved in self._saved.items():
                if saved is None:
                    delattr(dist.ProcessGroup, name)
                else:
                    setattr(dist.ProcessGroup, name, saved)
            for stream in self._streams.values():
                stream.close()
            self._streams.clear()
            self._pending.clear()
            self._waited_calls.clear()
        if self._errors and exc[0] is None:
            raise RuntimeError("NcclSemantics: deferred calls failed: " + "; ".join(self._errors))
