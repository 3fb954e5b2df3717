"""Send the policy's weights to the rollout servers, in Hugging Face names and layouts.

Called on EVERY training rank after a training phase::

    stats = sync_weights(gpt, cfg.model, pg, server_urls, transport="disk",
                         weight_version=str(step), shared_dir="/shared/run/weights")

or, to keep the plan (and the NCCL/gloo group of the distributed transport) across steps::

    syncer = WeightSyncer(gpt, cfg.model, pg, server_urls, transport="distributed")
    for step in ...:
        syncer.sync(weight_version=str(step))
    syncer.close()

What happens (steps 1 and 2 are :class:`HFGather`, usable alone through
:func:`iter_full_hf_tensors`, e.g. to export the live policy):

1. **Plan** (once): every rank lists its weights as HF pieces with the one mapping
   (``model.local_hf_pieces`` -> ``hf_mapping.pieces_for``, the same code as conversion) and
   all-gathers the piece keys (HF name index + region: a few ints per piece). Each distinct region
   is sent by the lowest rank holding it (replicas over DP, TP-replicated norms, ... send once),
   and rank 0 checks that the regions cover every element of every HF tensor exactly once. HF
   tensors are grouped, in ``hf_param_names`` order, into buckets of at most ``bucket_bytes``.
2. **Gather** (per bucket): each rank sends its pieces of the bucket as one flat buffer to global
   rank 0 (point-to-point), which assembles the full HF tensors: memory is bounded by a bucket.
3. **Send** (global rank 0): ``pause_generation`` on every server, then per bucket
   ``update_weights_from_tensor`` (base64 safetensors, see :mod:`pipeline.weight_transport`) or
   ``update_weights_from_distributed`` (broadcast on a group of its own) - or, for ``disk``, one
   safetensors shard per bucket in ``shared_dir`` and ``update_weights_from_disk`` at the end -,
   the last call tagging ``weight_version``; then ``flush_cache`` (polled until 200) and
   ``continue_generation``. If any server fails, the servers are left paused (their weights may be
   half-updated) and every rank raises the same :class:`WeightSyncError`.

``release_memory`` / ``resume_memory`` wrap SGLang's ``release_memory_occupation`` /
``resume_memory_occupation`` for colocated servers (call them from one rank).
"""

from __future__ import annotations

import concurrent.futures
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_gspo.config import ModelConfig
from megatron_gspo.hf.mapping import hf_param_names, hf_param_shapes
from pipeline import rollout
from pipeline.weight_transport import (broadcast, dtype_name, encode_named_tensors,
                                       new_update_group)

Transport = Literal["disk", "tensor", "distributed"]
DEFAULT_BUCKET_BYTES = 256 * 2**20


class WeightSyncError(RuntimeError):
    """The weight sync failed; raised on every rank with rank 0's message."""


@dataclass
class SyncStats:
    weight_version: str
    transport: str
    num_tensors: int = 0
    num_buckets: int = 0
    bytes: int = 0
    seconds_total: float = 0.0
    seconds_gather: float = 0.0
    seconds_send: float = 0.0
    phases: dict = field(default_factory=dict)

    @property
    def gbytes_per_s(self) -> float:
        return self.bytes / max(self.seconds_total, 1e-9) / 1e9


def _region(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A piece's slices as ((start, stop), ...) over every dim of the full HF tensor."""
    out = []
    for dim, size in enumerate(shape):
        sl = index[dim] if dim < len(index) else slice(None)
        start, stop, step = sl.indices(size)
        if step != 1:
            raise ValueError(f"strided HF piece {index} is not supported")
        out.append((start, stop))
    return tuple(out)


def _numel(region) -> int:
    n = 1
    for start, stop in region:
        n *= stop - start
    return n


def _slices(region) -> tuple:
    return tuple(slice(a, b) for a, b in region)


@dataclass
class _Plan:
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    keys_by_rank: list[list[tuple]]  # every rank's piece keys, in its iteration order
    send_by_rank: list[list[int]]  # per rank, indices (into its keys) it sends
    buckets: list[list[int]]  # name indices per bucket


def _local_pieces(gpt, model_cfg, pg_collection):
    from megatron_gspo.model.gpt import local_hf_pieces

    if isinstance(gpt, (list, tuple)):
        if len(gpt) != 1:
            raise NotImplementedError("weight sync of virtual-pipeline model chunks")
        gpt = gpt[0]
    return list(local_hf_pieces(gpt, model_cfg, pg_collection))


def _build_plan(pieces, model_cfg: ModelConfig, dtype: torch.dtype, bucket_bytes: int) -> _Plan:
    names = hf_param_names(model_cfg)
    shapes = hf_param_shapes(model_cfg)
    index = {n: i for i, n in enumerate(names)}
    keys = [(index[p.hf_name], _region(p.hf_index, shapes[p.hf_name])) for p, _ in pieces]
    world = dist.get_world_size()
    keys_by_rank: list = [None] * world
    dist.all_gather_object(keys_by_rank, keys)
    owner: dict = {}
    for r, rank_keys in enumerate(keys_by_rank):
        for k in rank_keys:
            owner.setdefault(k, r)
    send_by_rank = []
    for r, rank_keys in enumerate(keys_by_rank):
        seen, mine = set(), []
        for i, k in enumerate(rank_keys):
            if owner[k] == r and k not in seen:
                seen.add(k)
                mine.append(i)
        send_by_rank.append(mine)
    # Coverage: the distinct regions of each HF tensor must add up to the whole tensor.
    covered = [0] * len(names)
    for k in owner:
        covered[k[0]] += _numel(k[1])
    problems = [f"{n}: {covered[i]} of {torch.Size(shapes[n]).numel()} elements held by the ranks"
                for i, n in enumerate(names) if covered[i] != torch.Size(shapes[n]).numel()]
    if problems:
        raise WeightSyncError("the ranks' HF pieces do not cover the model exactly: "
                              + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))
    itemsize = torch.empty((), dtype=dtype).element_size()
    buckets, current, size = [], [], 0
    for i, n in enumerate(names):
        nbytes = torch.Size(shapes[n]).numel() * itemsize
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    if current:
        buckets.append(current)
    return _Plan(names, shapes, dtype, keys_by_rank, send_by_rank, buckets)


class HFGather:
    """Full HF tensors of the live, sharded policy on global rank 0, bucket by bucket.

    Collective over the default group (every rank calls the same methods in the same order).
    The plan - which rank sends which region, the buckets - is made on the first
    :meth:`local_pieces` call and kept (the layout does not change during a run). Each region is
    sent once (by its lowest holding rank), as one flat buffer per rank and bucket, point to point
    (gloo and NCCL): rank 0 holds one bucket at a time, the other ranks nothing extra.

        gather = HFGather(model_cfg, bucket_bytes=256 << 20)
        for tensors in gather.iter_buckets(gpt, pg):   # {hf name: full tensor} on rank 0, {} elsewhere
            ...
    """

    def __init__(self, model_cfg: ModelConfig, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: Optional[torch.dtype] = None):
        self.model_cfg = model_cfg
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.plan: Optional[_Plan] = None

    def local_pieces(self, gpt, pg_collection) -> list:
        """This rank's (Piece, tensor) list; makes the plan the first time (collective)."""
        pieces = _local_pieces(gpt, self.model_cfg, pg_collection)
        if self.plan is None:
            dtype = self.dtype or (pieces[0][1].dtype if pieces else torch.float32)
            self.plan = _build_plan(pieces, self.model_cfg, dtype, self.bucket_bytes)
        return pieces

    @property
    def num_buckets(self) -> int:
        return len(self.plan.buckets)

    def iter_buckets(self, gpt, pg_collection):
        pieces = self.local_pieces(gpt, pg_collection)
        for b in range(self.num_buckets):
            yield self.gather(b, pieces)

    def gather(self, b: int, pieces) -> dict[str, torch.Tensor]:
        """Full HF tensors of bucket ``b`` on global rank 0 (CPU); {} on the other ranks."""
        plan, rank, world = self.plan, dist.get_rank(), dist.get_world_size()
        bucket = plan.buckets[b]
        in_bucket = set(bucket)
        mine = [i for i in plan.send_by_rank[rank] if plan.keys_by_rank[rank][i][0] in in_bucket]
        if rank != 0:
            if mine:
                flat = torch.cat([pieces[i][1].reshape(-1).to(plan.dtype) for i in mine])
                dist.send(flat.contiguous(), dst=0)
            return {}
        device = pieces[0][1].device if pieces else torch.device("cpu")
        full = {plan.names[i]: torch.empty(plan.shapes[plan.names[i]], dtype=plan.dtype)
                for i in bucket}
        for i in mine:  # rank 0's own pieces
            name_i, region = plan.keys_by_rank[0][i]
            full[plan.names[name_i]][_slices(region)] = pieces[i][1].to("cpu", plan.dtype)
        for r in range(1, world):
            theirs = [i for i in plan.send_by_rank[r] if plan.keys_by_rank[r][i][0] in in_bucket]
            if not theirs:
                continue
            regions = [plan.keys_by_rank[r][i] for i in theirs]
            buf = torch.empty(sum(_numel(reg) for _, reg in regions), dtype=plan.dtype,
                              device=device)
            dist.recv(buf, src=r)
            buf = buf.cpu()
            off = 0
            for name_i, region in regions:
                n = _numel(region)
                shape = tuple(b - a for a, b in region)
                full[plan.names[name_i]][_slices(region)] = buf[off:off + n].view(shape)
                off += n
        return full


def iter_full_hf_tensors(gpt, model_cfg: ModelConfig, pg_collection, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         dtype: Optional[torch.dtype] = None):
    """Collective: yields {hf name: full tensor} buckets on rank 0 ({} elsewhere)."""
    yield from HFGather(model_cfg, bucket_bytes=bucket_bytes, dtype=dtype).iter_buckets(
        gpt, pg_collection)


class WeightSyncer:
    """Pushes the policy's weights to rollout servers; see the module docstring."""

    def __init__(self, gpt, model_cfg: ModelConfig, pg_collection, server_urls: Sequence[str], *,
                 transport: Transport = "disk", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 shared_dir: Optional[str | Path] = None, dtype: Optional[torch.dtype] = None,
                 pause_mode: str = "abort", timeout_s: float = 600.0,
                 master_address: str = "127.0.0.1", master_port: Optional[int] = None,
                 group_name: str = "weight_update_group", backend: Optional[str] = None,
                 flattened_bucket: bool = False, keep_versions: int = 1):
        if transport not in ("disk", "tensor", "distributed"):
            raise ValueError(f"transport {transport!r}: expected 'disk', 'tensor' or 'distributed'")
        if transport == "disk" and shared_dir is None:
            raise ValueError("transport 'disk' needs shared_dir (a filesystem the servers read)")
        if transport == "distributed" and master_port is None and dist.get_rank() == 0:
            from pipeline.servers import free_port
            master_port = free_port(master_address)
        self.gpt, self.model_cfg, self.pg = gpt, model_cfg, pg_collection
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.shared_dir = Path(shared_dir) if shared_dir is not None else None
        self.dtype = dtype
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.master_address, self.master_port = master_address, master_port
        self.group_name = group_name
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.flattened_bucket = flattened_bucket
        self.keep_versions = keep_versions
        self._gather = HFGather(model_cfg, bucket_bytes=bucket_bytes, dtype=dtype)
        self._group = None
        self._store = None
        self._written: list[Path] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(server_urls)))

    # ------------------------------------------------------------------ public
    def sync(self, weight_version: str) -> SyncStats:
        t_start = time.perf_counter()
        rank = dist.get_rank()
        pieces = self._gather.local_pieces(self.gpt, self.pg)
        plan = self._gather.plan
        stats = SyncStats(weight_version=str(weight_version), transport=self.transport,
                          num_tensors=len(plan.names), num_buckets=len(plan.buckets))
        error: Optional[str] = None
        try:
            if rank == 0:
                self._begin(stats)
        except Exception as err:  # noqa: BLE001 - shared with the other ranks below
            error = f"{type(err).__name__}: {err}"
        for b in range(len(plan.buckets)):
            t0 = time.perf_counter()
            tensors = self._gather.gather(b, pieces)
            stats.seconds_gather += time.perf_counter() - t0
            if rank == 0 and error is None:
                t0 = time.perf_counter()
                try:
                    stats.bytes += sum(t.numel() * t.element_size() for t in tensors.values())
                    self._send_bucket(b, tensors, weight_version, last=b == len(plan.buckets) - 1)
                except Exception as err:  # noqa: BLE001 - keep draining the gathers, then raise
                    error = f"{type(err).__name__}: {err}"
                stats.seconds_send += time.perf_counter() - t0
            del tensors
        if rank == 0 and error is None:
            try:
                self._end(weight_version, stats)
            except Exception as err:  # noqa: BLE001
                error = f"{type(err).__name__}: {err}"
        status = [error]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None:
            raise WeightSyncError(f"weight sync to {self.server_urls} failed (servers left paused): "
                                  f"{status[0]}")
        stats.seconds_total = time.perf_counter() - t_start
        return stats

    def close(self) -> None:
        if dist.get_rank() == 0 and self._group is not None:
            for url in self.server_urls:
                try:
                    rollout.control(url, "/destroy_weights_update_group",
                                    {"group_name": self.group_name}, timeout_s=30)
                except rollout.RolloutError:
                    pass
        self._group = self._store = None
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ send (rank 0)
    def _each_server(self, fn) -> list:
        futures = [self._pool.submit(fn, url) for url in self.server_urls]
        return [f.result() for f in futures]

    def _begin(self, stats: SyncStats) -> None:
        t0 = time.perf_counter()
        self._each_server(lambda u: rollout.control(u, "/pause_generation",
                                                    {"mode": self.pause_mode},
                                                    timeout_s=self.timeout_s))
        stats.phases["pause_s"] = time.perf_counter() - t0
        if self.transport == "distributed" and self._group is None:
            t0 = time.perf_counter()
            world = 1 + len(self.server_urls)
            body = lambda i: {"master_address": self.master_address, "master_port": self.master_port,
                              "rank_offset": 1 + i, "world_size": world,
                              "group_name": self.group_name, "backend": self.backend}
            # The servers' calls block until rank 0 joins too: issue them concurrently.
            futures = [self._pool.submit(rollout.control, u, "/init_weights_update_group",
                                         body(i), timeout_s=self.timeout_s)
                       for i, u in enumerate(self.server_urls)]
            self._group, self._store = new_update_group(
                self.master_address, self.master_port, 0, world, group_name=self.group_name,
                backend=self.backend, timeout_s=self.timeout_s)
            for f in futures:
                f.result()
            stats.phases["init_group_s"] = time.perf_counter() - t0

    def _send_bucket(self, b: int, tensors: dict[str, torch.Tensor], version: str, *,
                     last: bool) -> None:
        tag = {"weight_version": str(version)} if last else {}
        if self.transport == "disk":
            from safetensors.torch import save_file

            out = self._version_dir(version, tmp=True)
            out.mkdir(parents=True, exist_ok=True)
            save_file({n: t.contiguous() for n, t in tensors.items()},
                      str(out / f"model-{b + 1:05d}-of-{len(self._gather.plan.buckets):05d}.safetensors"))
        elif self.transport == "tensor":
            payload = encode_named_tensors(tensors.items())
            body = {"serialized_named_tensors": [payload], "load_format": None,
                    "flush_cache": False, "abort_all_requests": False, **tag}
            self._each_server(lambda u: rollout.control(u, "/update_weights_from_tensor", body,
                                                        timeout_s=self.timeout_s))
        else:
            names = list(tensors)
            body = {"names": names, "dtypes": [dtype_name(tensors[n].dtype) for n in names],
                    "shapes": [list(tensors[n].shape) for n in names],
                    "group_name": self.group_name, "flush_cache": False,
                    "abort_all_requests": False,
                    "load_format": "flattened_bucket" if self.flattened_bucket else None, **tag}
            futures = [self._pool.submit(rollout.control, u, "/update_weights_from_distributed",
                                         body, timeout_s=self.timeout_s)
                       for u in self.server_urls]
            device = "cuda" if self.backend == "nccl" else "cpu"
            if self.flattened_bucket:
                flat = torch.cat([tensors[n].reshape(-1).view(torch.uint8) for n in names])
                broadcast(self._group, flat.to(device), 0)
            else:
                for n in names:
                    broadcast(self._group, tensors[n].to(device).contiguous(), 0)
            for f in futures:
                f.result()

    def _version_dir(self, version: str, *, tmp: bool = False) -> Path:
        return self.shared_dir / (f"weights_v{version}" + (".tmp" if tmp else ""))

    def _end(self, version: str, stats: SyncStats) -> None:
        if self.transport == "disk":
            import json

            tmp, final = self._version_dir(version, tmp=True), self._version_dir(version)
            weight_map = {}
            for b, bucket in enumerate(self._gather.plan.buckets):
                fname = f"model-{b + 1:05d}-of-{len(self._gather.plan.buckets):05d}.safetensors"
                weight_map.update({self._gather.plan.names[i]: fname for i in bucket})
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": stats.bytes}, "weight_map": weight_map}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            t0 = time.perf_counter()
            self._each_server(lambda u: rollout.control(
                u, "/update_weights_from_disk",
                {"model_path": str(final), "weight_version": str(version), "flush_cache": True},
                timeout_s=self.timeout_s))
            stats.phases["load_from_disk_s"] = time.perf_counter() - t0
            self._written.append(final)
            while len(self._written) > self.keep_versions:
                shutil.rmtree(self._written.pop(0), ignore_errors=True)
        t0 = time.perf_counter()
        if self.pause_mode == "abort":  # retract / in_place keep requests: the flush would wait
            self._each_server(lambda u: rollout.flush_cache(u, timeout_s=self.timeout_s))
        self._each_server(lambda u: rollout.control(u, "/continue_generation", {},
                                                    timeout_s=self.timeout_s))
        stats.phases["flush_continue_s"] = time.perf_counter() - t0


def sync_weights(gpt, model_cfg: ModelConfig, pg_collection, server_urls: Sequence[str], *,
                 transport: Transport = "disk", weight_version: str,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, shared_dir: Optional[str | Path] = None,
                 **kwargs) -> SyncStats:
    """One sync with a fresh :class:`WeightSyncer` (plan and group are not kept)."""
    syncer = WeightSyncer(gpt, model_cfg, pg_collection, server_urls, transport=transport,
                          bucket_bytes=bucket_bytes, shared_dir=shared_dir, **kwargs)
    try:
        return syncer.sync(weight_version)
    finally:
        syncer.close()


def release_memory(server_urls: Sequence[str], tags: Optional[list[str]] = None, *,
                   timeout_s: float = 120.0) -> None:
    """Colocated mode, before training: ``release_memory_occupation`` on every server."""
    for url in server_urls:
        rollout.control(url, "/release_memory_occupation", {"tags": tags}, timeout_s=timeout_s)


def resume_memory(server_urls: Sequence[str], tags: Optional[list[str]] = None, *,
                  timeout_s: float = 120.0) -> None:
    """Colocated mode, after training: ``resume_memory_occupation`` on every server (slime
    resumes ``["weights"]`` before the weight sync and ``["kv_cache", "cuda_graph"]`` after)."""
    for url in server_urls:
        rollout.control(url, "/resume_memory_occupation", {"tags": tags}, timeout_s=timeout_s)
