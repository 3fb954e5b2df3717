"""The local server's weight-update side per tensor-parallel rank: SGLang's own code where it is
installed, the extra TP ranks of ``--tp-size N`` as processes of their own.

**Whose code.** :func:`sglang_impl` imports SGLang's ``init_custom_process_group``,
``MultiprocessingSerializer`` and ``FlattenedTensorBucket`` when the ``sglang`` package is
importable (a GPU machine with SGLang, or the tests, which put those three pieces of the 0.5.23
wheel on ``PYTHONPATH``), and falls back to :mod:`pipeline.weights.transport`'s implementations of
the same protocol otherwise. ``/server_info`` reports which one runs (``weight_sync_impl``).

**TP ranks.** SGLang runs one scheduler process per TP rank; each joins the update group at
``rank_offset + tp_rank``, receives every broadcast, and deserialises its own entry of
``serialized_named_tensors``. The local server does the same with ``tp_size - 1`` worker
processes (:func:`worker_main`) beside its own rank 0. A worker holds the full weights as plain
tensors (no model: the engine of rank 0 generates) so that it can apply updates and deltas and
report the checksum of what it holds; the server answers only when every rank has.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from megatron_gspo.hf.fp8 import dequantize, is_quantized, quantize
from pipeline.local.weight_table import fp8_update, shard_files
from pipeline.weights import transport as wt


@dataclass
class SGLangImpl:
    init_custom_process_group: Callable
    deserialize: Callable
    bucket_class: Any  # has .empty(names, dtypes, shapes, device), .get_flattened_tensor(), ...
    origin: str


class _FlattenedTensorBucket:
    """Fallback with the interface of SGLang's ``FlattenedTensorBucket`` (receive side)."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            raise NotImplementedError("the fallback bucket only receives")
        self.flat, self.layout = flattened_tensor, metadata

    @classmethod
    def empty(cls, names, dtypes, shapes, device):
        layout, total = wt.flat_layout(names, dtypes, shapes)
        return cls(flattened_tensor=torch.empty(total, dtype=torch.uint8, device=device),
                   metadata=layout)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flat

    def get_metadata(self):
        return self.layout

    def reconstruct_tensors(self):
        return wt.unflatten(self.flat, self.layout)


class ReceiveBuffers:
    """Reused receive buffers for flattened buckets (``count`` of them, each grown to the largest
    bucket seen): a fresh 64 MiB ``torch.empty`` per bucket costs a page fault and the kernel's
    zeroing per 4 KiB page, about two memory copies, on every bucket of every sync.

    :meth:`bucket` lays the bucket out with the implementation's own ``FlattenedTensorBucket``
    (``empty`` on the ``meta`` device: SGLang's checks and metadata, no allocation) over one of
    these buffers; :meth:`release` hands it back once the bucket is loaded. When all ``count``
    are out (loads still running) it waits up to ``wait_s``, then allocates a fresh buffer rather
    than block the receive for longer (a buffer never released must not hang the server)."""

    def __init__(self, count: int = 2, wait_s: float = 10.0):
        self.count, self.wait_s = count, wait_s
        self._free: list[torch.Tensor] = []
        self._out = 0
        self._cond = threading.Condition()

    def bucket(self, impl: "SGLangImpl", names, dtypes, shapes):
        shell = impl.bucket_class.empty(names, dtypes, shapes, "meta")
        total = shell.get_flattened_tensor().numel()
        with self._cond:
            deadline = time.monotonic() + self.wait_s
            while not self._free and self._out >= self.count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            buf = self._free.pop() if self._free else torch.empty(0, dtype=torch.uint8)
            self._out += 1
        if buf.numel() < total:
            buf = torch.empty(total, dtype=torch.uint8)
        bucket = impl.bucket_class(flattened_tensor=buf[:total], metadata=shell.get_metadata())
        return bucket, buf

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._out -= 1
            if len(self._free) + self._out < self.count:  # keep at most ``count``
                self._free.append(buf)
            self._cond.notify()


def sglang_impl() -> SGLangImpl:
    try:
        import sglang.srt.utils as sgl_utils
        from sglang.srt.utils import MultiprocessingSerializer, init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        return SGLangImpl(wt.init_custom_process_group, wt.deserialize_tensors,
                          _FlattenedTensorBucket, "pipeline.weights.transport")
    return SGLangImpl(init_custom_process_group, MultiprocessingSerializer.deserialize,
                      FlattenedTensorBucket, f"sglang ({Path(sgl_utils.__file__).parent})")


def join_group(impl: SGLangImpl, address: str, port: int, rank: int, world: int, name: str,
               backend: str, timeout_s: float):
    """What SGLang's ``WeightUpdater.init_weights_update_group`` does for one TP rank."""
    return impl.init_custom_process_group(
        backend=backend, init_method=wt.tcp_init_method(address, port), world_size=world,
        rank=rank, group_name=name, timeout=datetime.timedelta(seconds=timeout_s))


def receive(impl: SGLangImpl, group, names, dtypes, shapes, load_format,
            buffers: Optional[ReceiveBuffers] = None) -> tuple[list, Optional[torch.Tensor]]:
    """What SGLang's ``receive_weights_from_distributed`` does: one broadcast of the flattened
    bucket, or one (async) broadcast per tensor. Returns (named tensors, the ``buffers`` buffer
    they are views of, to :meth:`ReceiveBuffers.release` once loaded; None without one)."""
    if load_format == "flattened_bucket":
        if buffers is None:
            bucket, buf = impl.bucket_class.empty(names, dtypes, shapes, "cpu"), None
        else:
            bucket, buf = buffers.bucket(impl, names, dtypes, shapes)
        try:
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        except BaseException:
            if buf is not None:
                buffers.release(buf)
            raise
        return bucket.reconstruct_tensors(), buf
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        w = torch.empty([int(s) for s in shape], dtype=wt.parse_dtype(dtype))
        handles.append(dist.broadcast(w, src=0, group=group, async_op=True))
        weights.append((name, w))
    for h in handles:
        h.wait()
    return weights, None


class MappedStorages:
    """Keeps the shared-memory storages of the last ``count`` tensor payloads mapped.

    torch rebuilds a ``file_system`` shared-memory storage from its cache
    (``torch.multiprocessing.reductions.shared_cache``, keyed by the storage's file name) while
    a mapping of it is alive; otherwise every payload maps the file afresh and pays a page fault
    per 4 KiB page on first touch (about a memory copy). The trainer reuses its two bucket
    buffers, so holding the last few mappings makes every later payload a cache hit. What is
    held: at most ``count`` buckets of the sender's memory, released when newer ones arrive."""

    def __init__(self, count: int = 4):
        self.count = count
        self._held: dict[int, torch.UntypedStorage] = {}  # data_ptr -> storage, oldest first

    def keep(self, named) -> None:
        for _, t in named:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            self._held.pop(key, None)
            self._held[key] = storage
        while len(self._held) > self.count:
            self._held.pop(next(iter(self._held)))


# ------------------------------------------------------------------------------------------------
# Worker processes (TP ranks 1 .. tp_size - 1)


class _Replica:
    """One extra TP rank: the full weights as tensors, its update groups."""

    def __init__(self, model_path: str, dtype: str, quantization: Optional[str] = None):
        self.dtype = getattr(torch, dtype)
        self.fp8 = quantization == "fp8"
        self.weights: dict[str, torch.Tensor] = {}
        for f in shard_files(model_path):
            for name, t in load_file(str(Path(model_path) / f)).items():
                self.weights[name] = t.to(self.dtype)
                if self.fp8 and is_quantized(name, t.shape):  # as rank 0's WeightTable does
                    self.weights[name] = dequantize(*quantize(self.weights[name]), self.dtype)
        self.impl = sglang_impl()
        self.groups: dict[str, Any] = {}
        self.buffers = ReceiveBuffers(1)  # one command at a time: one receive buffer
        self.mapped = MappedStorages()

    def apply(self, named: list, delta: bool) -> str:
        full, deltas = wt.delta_pairs(named) if delta else (dict(named), {})
        received = {}  # FP8: the checksum parts of the blocks and scales as received
        if self.fp8:
            full, received = fp8_update(full, self.dtype)
        for name, t in full.items():
            if name not in self.weights or tuple(self.weights[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: not a weight of this shape")
            if t.dtype == torch.float8_e4m3fn:  # a server without --quantization fp8
                raise ValueError(f"{name}: float8_e4m3fn, but this server runs without "
                                 "--quantization fp8")
        parts = dict(received)  # each weight summed right after it is written, while in cache
        for name, t in full.items():
            self.weights[name].copy_(t)
            if name not in parts:
                parts[name] = wt.tensor_sums(self.weights[name].to(t.dtype))
        for name, (index, values) in deltas.items():
            wt.delta_apply(self.weights[name], index, values)
            parts[name] = wt.tensor_sums(self.weights[name].to(values.dtype))
        return wt.checksum_digest(parts)

    def run(self, cmd: str, kw: dict):
        if cmd == "init_group":
            self.groups[kw["name"]] = join_group(self.impl, kw["address"], kw["port"], kw["rank"],
                                                 kw["world"], kw["name"], kw["backend"],
                                                 kw["timeout_s"])
            return None
        if cmd == "destroy_group":
            group = self.groups.pop(kw["name"], None)
            if group is not None:
                wt.destroy_group(group)
            return None
        if cmd == "distributed":
            named, buf = receive(self.impl, self.groups[kw["name"]], kw["names"], kw["dtypes"],
                                 kw["shapes"], kw["load_format"], self.buffers)
            try:
                return self.apply(named, kw["delta"])
            finally:
                if buf is not None:
                    self.buffers.release(buf)
        if cmd == "tensor":
            named = list(self.impl.deserialize(kw["payload"]))
            self.mapped.keep(named)
            return self.apply(named, kw["delta"])
        if cmd == "named":
            return self.apply(kw["named"], kw["delta"])
        if cmd == "disk":
            return {f: self.apply(list(load_file(str(Path(kw["path"]) / f)).items()), False)
                    for f in shard_files(kw["path"])}
        if cmd == "checksum":
            return wt.weights_checksum(self.weights.items())
        raise ValueError(f"unknown command {cmd!r}")


def worker_main(conn, model_path: str, dtype: str, quantization: Optional[str] = None) -> None:
    torch.set_num_threads(1)
    try:
        replica = _Replica(model_path, dtype, quantization)
        conn.send(("ok", None))
    except BaseException as err:  # noqa: BLE001 - reported to the server
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    while True:
        try:
            cmd, kw = conn.recv()
        except EOFError:
            return
        if cmd == "stop":
            return
        try:
            conn.send(("ok", replica.run(cmd, kw)))
        except BaseException as err:  # noqa: BLE001 - reported to the server
            conn.send(("error", f"{type(err).__name__}: {err}"))


class TPWorkers:
    """The server's TP ranks 1 .. tp_size - 1 (processes); rank r's calls are serialized, in the
    order they were submitted (:meth:`submit`: one thread per rank). The order matters: two
    broadcasts of one update group must reach every member in the same order, and a lock's
    waiters are not woken in arrival order."""

    def __init__(self, tp_size: int, model_path: str, dtype: str,
                 quantization: Optional[str] = None):
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.locks = [], [], []
        for _ in range(tp_size - 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main,
                               args=(child, str(model_path), dtype, quantization),
                               daemon=True, name="tp-rank")
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
            self.locks.append(threading.Lock())
        for i, conn in enumerate(self.conns):
            kind, value = conn.recv()
            if kind != "ok":
                raise RuntimeError(f"TP rank {i + 1} did not start: {value}")
        self.executors = [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tp{i + 1}")
                          for i in range(len(self.procs))]

    def submit(self, i: int, cmd: str, kw: Optional[dict] = None) -> concurrent.futures.Future:
        """:meth:`call` on TP rank ``i + 1``, after every command submitted to it before."""
        return self.executors[i].submit(self.call, i, cmd, kw)

    def __len__(self) -> int:
        return len(self.procs)

    def call(self, i: int, cmd: str, kw: Optional[dict] = None):
        """Run ``cmd`` on TP rank ``i + 1`` (blocking); raises RuntimeError with its message."""
        with self.locks[i]:
            self.conns[i].send((cmd, kw or {}))
            kind, value = self.conns[i].recv()
        if kind != "ok":
            raise RuntimeError(f"TP rank {i + 1}: {value}")
        return value

    def stop(self) -> None:
        for ex in getattr(self, "executors", []):
            ex.shutdown(wait=False)
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(("stop", None))
            except (OSError, BrokenPipeError):
                pass
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
