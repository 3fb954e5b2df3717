"""The local server's weight-update side per tensor-parallel rank: SGLang's own code where it is
installed, the extra TP ranks of ``--tp-size N`` as processes of their own.

**Whose code.** :func:`sglang_impl` imports SGLang's ``init_custom_process_group``,
``MultiprocessingSerializer`` and ``FlattenedTensorBucket`` when the ``sglang`` package is
importable (a GPU machine with SGLang, or the tests, which put those three pieces of the 0.5.23
wheel on ``PYTHONPATH``), and falls back to :mod:`pipeline.weight_transport`'s implementations of
the same protocol otherwise. ``/server_info`` reports which one runs (``weight_sync_impl``).

**TP ranks.** SGLang runs one scheduler process per TP rank; each joins the update group at
``rank_offset + tp_rank``, receives every broadcast, and deserialises its own entry of
``serialized_named_tensors``. The local server does the same with ``tp_size - 1`` worker
processes (:func:`worker_main`) beside its own rank 0. A worker holds the full weights as plain
tensors (no model: the engine of rank 0 generates) so that it can apply updates and deltas and
report the checksum of what it holds; the server answers only when every rank has.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pipeline import weight_transport as wt


@dataclass
class SGLangImpl:
    init_custom_process_group: Callable
    deserialize: Callable
    bucket_class: Any  # has .empty(names, dtypes, shapes, device), .get_flattened_tensor(), ...
    origin: str


class _FlattenedTensorBucket:
    """Fallback with the interface of SGLang's ``FlattenedTensorBucket`` (receive side)."""

    def __init__(self, flat: torch.Tensor, layout):
        self.flat, self.layout = flat, layout

    @classmethod
    def empty(cls, names, dtypes, shapes, device):
        layout, total = wt.flat_layout(names, dtypes, shapes)
        return cls(torch.empty(total, dtype=torch.uint8, device=device), layout)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flat

    def reconstruct_tensors(self):
        return wt.unflatten(self.flat, self.layout)


def sglang_impl() -> SGLangImpl:
    try:
        import sglang.srt.utils as sgl_utils
        from sglang.srt.utils import MultiprocessingSerializer, init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        return SGLangImpl(wt.init_custom_process_group, wt.deserialize_tensors,
                          _FlattenedTensorBucket, "pipeline.weight_transport")
    return SGLangImpl(init_custom_process_group, MultiprocessingSerializer.deserialize,
                      FlattenedTensorBucket, f"sglang ({Path(sgl_utils.__file__).parent})")


def join_group(impl: SGLangImpl, address: str, port: int, rank: int, world: int, name: str,
               backend: str, timeout_s: float):
    """What SGLang's ``WeightUpdater.init_weights_update_group`` does for one TP rank."""
    import datetime

    return impl.init_custom_process_group(
        backend=backend, init_method=wt.tcp_init_method(address, port), world_size=world,
        rank=rank, group_name=name, timeout=datetime.timedelta(seconds=timeout_s))


def receive(impl: SGLangImpl, group, names, dtypes, shapes, load_format) -> list:
    """What SGLang's ``receive_weights_from_distributed`` does: one broadcast of the flattened
    bucket, or one (async) broadcast per tensor."""
    import torch.distributed as dist

    if load_format == "flattened_bucket":
        bucket = impl.bucket_class.empty(names, dtypes, shapes, "cpu")
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        return bucket.reconstruct_tensors()
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        w = torch.empty([int(s) for s in shape], dtype=wt.parse_dtype(dtype))
        handles.append(dist.broadcast(w, src=0, group=group, async_op=True))
        weights.append((name, w))
    for h in handles:
        h.wait()
    return weights


def wire_dtypes(full: dict, deltas: dict) -> list[tuple[str, torch.dtype]]:
    """(name, dtype it was sent in) of every tensor an update touched."""
    return [(n, t.dtype) for n, t in full.items()] + [(n, v.dtype) for n, (_, v) in deltas.items()]


# ------------------------------------------------------------------------------------------------
# Worker processes (TP ranks 1 .. tp_size - 1)


class _Replica:
    """One extra TP rank: the full weights as tensors, its update groups."""

    def __init__(self, model_path: str, dtype: str):
        from safetensors.torch import load_file

        from pipeline.local.engine import shard_files

        self.dtype = getattr(torch, dtype)
        self.weights: dict[str, torch.Tensor] = {}
        for f in shard_files(model_path):
            for name, t in load_file(str(Path(model_path) / f)).items():
                self.weights[name] = t.to(self.dtype)
        self.impl = sglang_impl()
        self.groups: dict[str, Any] = {}

    def apply(self, named: list, delta: bool) -> str:
        full, deltas = wt.delta_pairs(named) if delta else (dict(named), {})
        for name, t in full.items():
            if name not in self.weights or tuple(self.weights[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: not a weight of this shape")
        for name, t in full.items():
            self.weights[name].copy_(t)
        for name, (index, values) in deltas.items():
            wt.delta_apply(self.weights[name], index, values)
        return wt.bucket_checksum((n, self.weights[n].to(d)) for n, d in wire_dtypes(full, deltas))

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
            named = receive(self.impl, self.groups[kw["name"]], kw["names"], kw["dtypes"],
                            kw["shapes"], kw["load_format"])
            return self.apply(named, kw["delta"])
        if cmd == "tensor":
            return self.apply(list(self.impl.deserialize(kw["payload"])), kw["delta"])
        if cmd == "named":
            return self.apply(kw["named"], kw["delta"])
        if cmd == "disk":
            from safetensors.torch import load_file

            from pipeline.local.engine import shard_files

            return {f: self.apply(list(load_file(str(Path(kw["path"]) / f)).items()), False)
                    for f in shard_files(kw["path"])}
        if cmd == "checksum":
            return wt.weights_checksum(self.weights.items())
        raise ValueError(f"unknown command {cmd!r}")


def worker_main(conn, model_path: str, dtype: str) -> None:
    torch.set_num_threads(1)
    try:
        replica = _Replica(model_path, dtype)
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
    """The server's TP ranks 1 .. tp_size - 1 (processes); rank r's calls are serialized."""

    def __init__(self, tp_size: int, model_path: str, dtype: str):
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.locks = [], [], []
        for _ in range(tp_size - 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, str(model_path), dtype),
                               daemon=True, name="tp-rank")
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
            self.locks.append(threading.Lock())
        for i, conn in enumerate(self.conns):
            kind, value = conn.recv()
            if kind != "ok":
                raise RuntimeError(f"TP rank {i + 1} did not start: {value}")

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
        for conn, proc in zip(self.conns, self.procs):
            try:
                conn.send(("stop", None))
            except (OSError, BrokenPipeError):
                pass
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
