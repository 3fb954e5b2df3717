"""Full Hugging Face tensors of the live, sharded policy, bucket by bucket, on the ranks that send
them (the Megatron side of the weight sync, and of the HF export).

Collective over the default group: every rank builds the same stream and iterates it to the end::

    stream = HFGather(model_cfg, bucket_bytes=256 << 20).buckets(gpt, pg)
    stream.sources                   # the global ranks that hold (and send) whole buckets
    for bucket in stream:            # the same Bucket metadata on every rank, in the same order
        if bucket.source == rank:    # the full tensors in SGLang's FlattenedTensorBucket layout
            bucket.named_tensors()   # [(hf name, view into bucket.flat)], valid until the next one

**Plan** (collective, once per :class:`HFGather`; the layout does not change during a run). Every
rank lists its weights as HF pieces with the one mapping (``hf.rank_pieces.local_hf_pieces`` ->
``hf.mapping.pieces_for``, the code conversion uses) and all-gathers the piece keys (HF name index
+ region: a few ints per piece). Then, on every rank alike:

* each HF tensor gets a **source** rank: the lowest rank that holds it whole, if one does (every
  tensor under DP or PP, the experts under EP, TP-replicated norms), else the lowest rank holding a
  piece of it (a TP-split matrix goes to the first rank of its TP group). So no tensor crosses a
  pipeline stage or an expert-parallel group, nothing funnels through global rank 0, and only
  TP / expert-TP shards move inside the trainer - each once, from the rank that owns it to its
  source rank, on the device (point-to-point in the default group: exactly the bytes that are
  needed, unlike an all-gather that would copy every shard to every TP rank);
* each distinct region is sent by one rank (the source itself when it holds a replica, else the
  lowest holder: DP replicas and TP-replicated norms send once), and the regions must cover every
  element of every HF tensor exactly once (else :class:`WeightSyncError`);
* each source's tensors, in ``hf_param_names`` order, form buckets of at most ``bucket_bytes``;
  the global order takes the sources in turn (bucket 0 of every source, then bucket 1, ...).

**Gather** (per bucket, in that global order, on every rank). A background thread assembles
bucket k+1 (its source's own regions copied into the flat buffer, the other owners' regions
received into it) while the caller sends bucket k: two flat buffers per source, reused across
buckets and syncs, so memory is bounded by two buckets. With a ``BucketStream.tensor_hook`` (the
pusher's checksum) the thread also runs the hook on each tensor as soon as all its regions are
in, while its bytes are still in cache (``Bucket.parts``).

Nothing here talks to a rollout server: ``pipeline.weights.push`` sends the buckets.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megatron_gspo.errors import InputError
from megatron_gspo.config import ModelConfig
from megatron_gspo.hf.mapping import hf_param_names, hf_param_shapes
from megatron_gspo.hf.rank_pieces import local_hf_pieces

DEFAULT_BUCKET_BYTES = 256 * 2**20


class WeightSyncError(RuntimeError, InputError):
    """The ranks' weights cannot be gathered into full HF tensors (the plan failed)."""


@dataclass
class Bucket:
    """One bucket of full HF tensors. Metadata on every rank; the bytes on ``source`` only.

    ``flat`` is SGLang's ``FlattenedTensorBucket`` layout (``sglang/srt/weight_sync/
    tensor_bucket.py``): the tensors' bytes (uint8), contiguous, one after the other, in ``names``
    order, no padding. It is a reused buffer: valid until the stream yields the next bucket.
    """

    index: int
    count: int
    source: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    flat: Optional[torch.Tensor] = None
    parts: Optional[dict] = None
    """On the source, with a ``BucketStream.tensor_hook``: {name: hook(name, tensor)} of every
    tensor, each computed right after the tensor was assembled (its bytes still in cache)."""

    @property
    def numels(self) -> list[int]:
        return [torch.Size(s).numel() for s in self.shapes]

    @property
    def nbytes(self) -> int:
        return sum(self.numels) * self.dtype.itemsize

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into ``flat`` (on the source rank)."""
        if self.flat is None:
            raise ValueError(f"bucket {self.index}: its bytes are on rank {self.source}")
        values = self.flat[: self.nbytes].view(self.dtype)
        out, off = [], 0
        for name, shape, n in zip(self.names, self.shapes, self.numels):
            out.append((name, values[off:off + n].view(shape)))
            off += n
        return out


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
class _BucketPlan:
    names: list[int]  # HF name indices, in flat order
    source: int
    offsets: dict[int, int]  # name index -> element offset in the flat bucket
    numel: int
    own: list[int] = field(default_factory=list)  # the source's piece indices it copies in
    sends: dict[int, list[int]] = field(default_factory=dict)  # other rank -> its piece indices


@dataclass
class _Plan:
    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    keys_by_rank: list[list[tuple]]  # every rank's piece keys, in its iteration order
    buckets: list[_BucketPlan]

    @property
    def sources(self) -> list[int]:
        return sorted({b.source for b in self.buckets})


def _local_pieces(gpt, model_cfg, pg_collection):
    if isinstance(gpt, (list, tuple)):
        if len(gpt) != 1:
            raise NotImplementedError("weight sync of virtual-pipeline model chunks")
        gpt = gpt[0]
    return list(local_hf_pieces(gpt, model_cfg, pg_collection))


def _build_plan(pieces, model_cfg: ModelConfig, dtype: torch.dtype, bucket_bytes: int, *,
                single_source: Optional[int], senders: Optional[list[int]] = None) -> _Plan:
    names = hf_param_names(model_cfg)
    shapes = hf_param_shapes(model_cfg)
    index = {n: i for i, n in enumerate(names)}
    keys = [(index[p.hf_name], _region(p.hf_index, shapes[p.hf_name])) for p, _ in pieces]
    world = dist.get_world_size()
    keys_by_rank: list = [None] * world
    dist.all_gather_object(keys_by_rank, keys)

    holders: dict[tuple, list[int]] = {}
    for r, rank_keys in enumerate(keys_by_rank):
        for k in rank_keys:
            if not holders.setdefault(k, []) or holders[k][-1] != r:
                holders[k].append(r)
    # Coverage: the distinct regions of each HF tensor must add up to the whole tensor.
    covered = [0] * len(names)
    for k in holders:
        covered[k[0]] += _numel(k[1])
    numel = [torch.Size(shapes[n]).numel() for n in names]
    problems = [f"{n}: {covered[i]} of {numel[i]} elements held by the ranks"
                for i, n in enumerate(names) if covered[i] != numel[i]]
    if problems:
        raise WeightSyncError("the ranks' HF pieces do not cover the model exactly: "
                              + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))

    source = [None] * len(names)
    whole = {i: tuple((0, s) for s in shapes[n]) for i, n in enumerate(names)}
    for (i, region), ranks in holders.items():
        if region == whole[i]:
            source[i] = min(ranks) if source[i] is None else min(source[i], min(ranks))
    partial_min: dict[int, int] = {}
    for (i, region), ranks in holders.items():
        partial_min[i] = min(partial_min.get(i, world), min(ranks))
    for i in range(len(names)):
        if single_source is not None:
            source[i] = single_source
        elif source[i] is None:
            source[i] = partial_min[i]
        if single_source is None and senders is not None:  # the sender of that rank's group
            source[i] = senders[source[i]]
    owner = {k: (source[k[0]] if source[k[0]] in ranks else min(ranks))
             for k, ranks in holders.items()}

    # Buckets per source, then the sources in turn.
    per_source: dict[int, list[list[int]]] = {}
    sizes: dict[int, int] = {}
    itemsize = dtype.itemsize
    for i in range(len(names)):
        s = source[i]
        chunks = per_source.setdefault(s, [[]])
        nbytes = numel[i] * itemsize
        if chunks[-1] and sizes.get(s, 0) + nbytes > bucket_bytes:
            chunks.append([])
            sizes[s] = 0
        chunks[-1].append(i)
        sizes[s] = sizes.get(s, 0) + nbytes
    order = []
    for j in range(max(len(c) for c in per_source.values())):
        for s in sorted(per_source):
            if j < len(per_source[s]):
                order.append((s, per_source[s][j]))
    buckets = []
    where: dict[int, int] = {}
    for b, (s, name_ids) in enumerate(order):
        offsets, off = {}, 0
        for i in name_ids:
            offsets[i] = off
            off += numel[i]
            where[i] = b
        buckets.append(_BucketPlan(names=name_ids, source=s, offsets=offsets, numel=off))
    for r, rank_keys in enumerate(keys_by_rank):
        seen = set()
        for p, k in enumerate(rank_keys):
            if owner[k] != r or k in seen:
                continue
            seen.add(k)
            bp = buckets[where[k[0]]]
            (bp.own if r == bp.source else bp.sends.setdefault(r, [])).append(p)
    return _Plan(names, shapes, dtype, keys_by_rank, buckets)


def sender_ranks(mode: str, pipeline_rank: int) -> Optional[list[int]]:
    """Collective (the default group): rank -> the rank that sends its tensors to the rollout
    servers, for ``rollout.weight_sync.senders``: ``rank`` -> None (every source rank sends its
    own: one update group per source); ``stage`` -> the lowest rank of its pipeline stage;
    ``node`` -> the lowest rank on the same host and pipeline stage (no byte crosses a node or a
    stage inside the trainer, and every server GPU joins one update group per node-stage)."""
    if mode == "rank":
        return None
    if mode not in ("stage", "node"):
        raise ValueError(f"rollout.weight_sync.senders {mode!r}: expected rank, stage or node")
    key = (socket.gethostname() if mode == "node" else "", pipeline_rank)
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    first: dict = {}
    for r, k in enumerate(keys):
        first.setdefault(tuple(k), r)
    return [first[tuple(k)] for k in keys]


class HFGather:
    """The plan, the buffers and the gather; see the module docstring. Collective: every rank
    calls the same methods in the same order.

    ``single_source``: send every tensor from that one rank (the HF export writes on rank 0).
    ``senders``: rank -> the rank that sends its tensors (:func:`sender_ranks`: one sender per
    node and pipeline stage, or per stage; the tensors move to it inside the trainer, over
    NVLink within a node); None: every source rank sends its own.
    """

    def __init__(self, model_cfg: ModelConfig, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: Optional[torch.dtype] = None, single_source: Optional[int] = None,
                 senders: Optional[list[int]] = None):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes: must be >= 1, got {bucket_bytes}")
        self.model_cfg = model_cfg
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.single_source = single_source
        self.senders = senders
        self.plan: Optional[_Plan] = None
        self._buffers: list[torch.Tensor] = []

    def local_pieces(self, gpt, pg_collection) -> list:
        """This rank's (Piece, tensor) list; makes the plan the first time (collective)."""
        pieces = _local_pieces(gpt, self.model_cfg, pg_collection)
        if self.plan is None:
            dtype = self.dtype or (pieces[0][1].dtype if pieces else torch.float32)
            self.plan = _build_plan(pieces, self.model_cfg, dtype, self.bucket_bytes,
                                    single_source=self.single_source, senders=self.senders)
        return pieces

    def buckets(self, gpt, pg_collection) -> "BucketStream":
        """Collective (the plan, the first time): the stream every rank must iterate to the end."""
        return BucketStream(self, self.local_pieces(gpt, pg_collection))

    def _buffer_pool(self, rank: int, device: torch.device) -> "queue.Queue":
        """Two flat buffers (uint8, the largest bucket this rank sends), made once."""
        plan = self.plan
        mine = [b.numel for b in plan.buckets if b.source == rank]
        pool: queue.Queue = queue.Queue()
        if not mine:
            return pool
        nbytes = max(mine) * plan.dtype.itemsize
        if not self._buffers or self._buffers[0].numel() < nbytes \
                or self._buffers[0].device != device:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device)
                             for _ in range(2)]
        for buf in self._buffers:
            pool.put(buf)
        return pool

    def _gather(self, b: int, pieces, pool: "queue.Queue", device, hook=None):
        """(bucket ``b``'s flat bytes, {name: hook(name, tensor)} or None) on its source rank;
        (None, None) on the other ranks (which send their regions to the source, if they own
        any). ``hook`` runs on each tensor as soon as all its regions are in."""
        plan, rank = self.plan, dist.get_rank()
        bp = plan.buckets[b]
        keys = plan.keys_by_rank
        if rank != bp.source:
            mine = bp.sends.get(rank)
            if mine:
                flat = torch.cat([pieces[p][1].reshape(-1).to(plan.dtype) for p in mine])
                dist.send(flat, dst=bp.source)
            return None, None
        buf = pool.get()
        values = buf[: bp.numel * plan.dtype.itemsize].view(plan.dtype)

        def whole(name_i: int) -> torch.Tensor:
            shape = plan.shapes[plan.names[name_i]]
            off = bp.offsets[name_i]
            return values[off: off + torch.Size(shape).numel()].view(shape)

        def target(name_i: int, region) -> torch.Tensor:
            return whole(name_i)[_slices(region)]

        parts = {} if hook is not None else None
        remaining: dict[int, int] = {}  # name index -> regions not copied in yet
        if hook is not None:
            for p in bp.own:
                remaining[keys[rank][p][0]] = remaining.get(keys[rank][p][0], 0) + 1
            for r, theirs in bp.sends.items():
                for p in theirs:
                    remaining[keys[r][p][0]] = remaining.get(keys[r][p][0], 0) + 1

        def copied(name_i: int) -> None:
            if hook is not None:
                remaining[name_i] -= 1
                if not remaining[name_i]:
                    parts[plan.names[name_i]] = hook(plan.names[name_i], whole(name_i))

        works = []
        for r, theirs in sorted(bp.sends.items()):
            size = sum(_numel(keys[r][p][1]) for p in theirs)
            recv = torch.empty(size, dtype=plan.dtype, device=device)
            works.append((r, theirs, recv, dist.irecv(recv, src=r)))
        for p in bp.own:  # meanwhile, the source's own regions
            name_i, region = keys[rank][p]
            target(name_i, region).copy_(pieces[p][1])
            copied(name_i)
        for r, theirs, recv, work in works:
            work.wait()
            off = 0
            for p in theirs:
                name_i, region = keys[r][p]
                n = _numel(region)
                shape = tuple(stop - start for start, stop in region)
                target(name_i, region).copy_(recv[off:off + n].view(shape))
                off += n
                copied(name_i)
        return buf, parts


class BucketStream:
    """The buckets of one gather, in send order. Iterate it on every rank, to the end: the
    iteration drives the collective gather (a background thread one bucket ahead)."""

    def __init__(self, gather: HFGather, pieces: list):
        self._gather, self._pieces = gather, pieces
        plan = gather.plan
        self.count = len(plan.buckets)
        self.meta = [Bucket(index=b, count=self.count, source=bp.source,
                            names=[plan.names[i] for i in bp.names],
                            shapes=[tuple(plan.shapes[plan.names[i]]) for i in bp.names],
                            dtype=plan.dtype)
                     for b, bp in enumerate(plan.buckets)]
        self.sources = plan.sources
        self.num_tensors = len(plan.names)
        self.total_bytes = sum(b.nbytes for b in self.meta)
        self.dtype = plan.dtype
        self.seconds_waited = 0.0  # time the consumer waited for the gather (not overlapped)
        self.tensor_hook = None
        """Set before iterating: ``hook(name, tensor)`` runs on the source on every full tensor
        right after its assembly (results in ``Bucket.parts``), e.g. a checksum that then reads
        bytes still in cache instead of a second pass over the bucket."""

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Bucket]:
        rank = dist.get_rank()
        device = self._pieces[0][1].device if self._pieces else torch.device("cpu")
        pool = self._gather._buffer_pool(rank, device)
        ready: queue.Queue = queue.Queue(maxsize=1)

        def produce() -> None:
            try:
                if device.type == "cuda":  # the current device is per thread (NCCL p2p, copies)
                    torch.cuda.set_device(device)
                for b in range(self.count):
                    ready.put(("ok", self._gather._gather(b, self._pieces, pool, device,
                                                          self.tensor_hook)))
            except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
                ready.put(("error", err))

        thread = threading.Thread(target=produce, name="hf-gather", daemon=True)
        thread.start()
        for meta in self.meta:
            t0 = time.perf_counter()
            kind, got = ready.get()
            self.seconds_waited += time.perf_counter() - t0
            if kind == "error":
                raise got
            flat, parts = got
            yield Bucket(index=meta.index, count=meta.count, source=meta.source,
                         names=meta.names, shapes=meta.shapes, dtype=meta.dtype, flat=flat,
                         parts=parts)
            if flat is not None:
                pool.put(flat)  # the consumer is done with it: reuse for a later bucket
        thread.join()


def iter_full_hf_tensors(gpt, model_cfg: ModelConfig, pg_collection, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         dtype: Optional[torch.dtype] = None):
    """Collective: yields {hf name: full CPU tensor} buckets on rank 0 ({} elsewhere); a bucket's
    tensors are valid until the next one is yielded."""
    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes, dtype=dtype, single_source=0)
    for bucket in gather.buckets(gpt, pg_collection):
        yield {n: t.cpu() for n, t in bucket.named_tensors()} if bucket.flat is not None else {}
