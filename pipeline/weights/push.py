"""Push the trainer's Hugging Face buckets to the rollout servers (the server side of the weight sync).

Called on EVERY training rank with the trainer's bucket stream (``RLTrainer.hf_buckets()``, a
collective the pusher iterates to the end on every rank)::

    pusher = WeightPusher(server_urls, transport="distributed", group=control_group)
    for step in ...:
        stats = pusher.push(trainer.hf_buckets(), version=str(step))
    pusher.close()

A bucket (duck-typed: ``index``, ``count``, ``source``, ``names``, ``shapes``, ``dtype``,
``nbytes``, ``flat``, ``named_tensors()``) is what ``megatron_gspo.hf.gather`` yields: full HF
tensors in SGLang's flattened layout, on the bucket's source rank. Each source rank sends its own
buckets; nothing funnels through rank 0. Wire formats: :mod:`pipeline.weights.transport`. What
differs between the three transports (the interface: :mod:`pipeline.weights.interface`) is in
one module each: :mod:`pipeline.weights.disk`, :mod:`pipeline.weights.tensor`,
:mod:`pipeline.weights.distributed`; the pusher chooses one in its constructor.

One push follows SGLang 0.5.23's contract (docs/sglang_protocol.md, "Weight updates"):

1. rank 0: ``/pause_generation {"mode": pause_mode}`` on every server (``abort``: in-flight
   requests come back aborted; ``retract``: they go back to the server's waiting queue and are
   recomputed under the new weights after ``continue_generation``); ``/server_info`` read once per
   server (``tp_size``, ``dp_size``, the extensions it offers); for ``tensor`` and
   ``distributed``, ``/begin_weight_update {"selector": "all"}`` (0.5.23 refuses those updates
   outside a weight-update session). The outcome goes to every rank (``group``, gloo).
2. ``distributed``, first push only: each source rank builds its own update group with every GPU
   of every server (world ``1 + sum(tp_size)``, server i at ``rank_offset`` 1 + the TP sizes before
   it, the source rank is rank 0, its address routable from the servers), one source after the
   other (a server joins one group at a time).
3. per bucket, on its source rank: ``update_weights_from_distributed`` (``load_format:
   flattened_bucket``, one broadcast of the flat bucket) or ``update_weights_from_tensor`` (one
   ``MultiprocessingSerializer`` entry per server TP rank: CUDA-IPC / shared-memory handles, no
   bytes over HTTP) or, for ``disk``, one safetensors shard per bucket written in parallel by
   every source rank; ``flush_cache: false`` and ``abort_all_requests: false`` on each (one
   flush at the end). A background thread gathers bucket k+1 meanwhile. **Order by
   construction**: a bucket's request goes out only after every server has answered the
   previous bucket (from whichever source), and the sources take turns bucket by bucket (a
   token passes from each bucket's source to the next's once its answers are in). A server
   answers an update only after it has received and loaded the bucket, so no server can take
   bucket k+1's names for bucket k's bytes, and no two sources' broadcasts are ever pending at
   once - whether the collective blocks the host (gloo) or only orders a CUDA stream (NCCL,
   where ``work.wait()`` returns at once).
4. rank 0: ``disk``: the index file, the rename, ``update_weights_from_disk`` (the directory of
   the version retired after that is kept as a spare whose files the next push overwrites in
   place: on tmpfs their pages are reused, not allocated and zeroed again); ``tensor`` /
   ``distributed``: ``/end_weight_update``; then ``update_weight_version {"abort_all_requests":
   false}`` (the version changes only once every bucket is in, and the label aborts nothing),
   ``flush_cache`` (polled until 200: the KV the old weights computed must go, also for
   retracted requests, which 0.5.23 recomputes), ``continue_generation``.

**Capabilities are negotiated.** The local rollout server's extensions (bucket ``checksums``,
``delta`` pushes, server ``timings``) are used only where ``/server_info`` offers them
(``megatron_gspo_extensions``), and asked for per request with the header
``X-Megatron-Gspo-Extensions``; every other request is plain SGLang. ``verify="auto"``
(the default) checks buckets where every server can report checksums and says once that it
cannot elsewhere; ``verify=True`` requires it. **Checks** (``verify``): for every bucket the
server reports a checksum of the tensors it now holds, per TP rank
(``transport.bucket_checksum``), compared with the trainer's own, which the gather
computes per tensor as it assembles it (``BucketStream.tensor_hook``). **Delta** (``delta``,
bf16 only): after a full push the sources keep the bytes they sent; later pushes send, per
tensor, only the changed elements when that is smaller (``transport.delta_encode``), and
a full push every ``full_every`` pushes or whenever a server's weight version (``/model_info``) is
not the one last pushed (a restarted server).

If anything fails, rank 0 closes the weight-update session, resumes generation on every server
that still answers (their weights may be half-updated: the next push is a full one), and every
rank raises the same :class:`WeightPushError`, naming the server and the call that failed. Each
step's outcome crosses ranks as the library's outcome protocol (``megatron_gspo.collectives``):
rank 0 raises the error there, every other rank a copy of it, raised from a copy of the error
behind it (its own type, e.g. ``RolloutError``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_gspo.collectives import Failure, Outcome, all_gather, broadcast, on_rank0
from megatron_gspo.errors import one_line
from pipeline.engines.base import Engine
from pipeline.engines.sglang import (EXTENSIONS_HEADER, EXTENSIONS_KEY, LOCAL_SERVER,  # noqa: F401
                                     SGLANG, offered_extensions)
from pipeline.generation import client as rollout
from pipeline.servers.paused import PausedServers
from pipeline.weights import fp8 as fp8_wire
from pipeline.weights import transport as wt
from pipeline.weights.interface import Transport, failure_at
from pipeline.weights.stats import SyncStats

TransportName = Literal["disk", "tensor", "distributed"]
_TOKEN_TAG = 7  # p2p tag of the sources' turn token (apart from the gather's messages)
_POOL_PER_SERVER = 4  # thread-pool workers per server (answers are collected bucket by bucket)

log = logging.getLogger("megatron_gspo.weight_sync")


def _tensor_sums(name: str, tensor: torch.Tensor):
    return wt.tensor_sums(tensor)


class _Done:
    """A finished future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class WeightPushError(RuntimeError):
    """The weight push failed; raised on every rank alike (the same message, naming the server,
    the call and the rank that failed). ``cause``: the failure behind it, which every rank
    raises it from (``__cause__``: that error as its own type where it crosses ranks)."""

    def __init__(self, message: str, cause: Optional[Failure] = None):
        super().__init__(message)
        self.cause = cause

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # unpickled on another rank: raised from its cause there too
        if getattr(self, "cause", None) is not None:
            self.__cause__ = self.cause.error()


class WeightPusher:
    """Pushes bucket streams to rollout servers; see the module docstring. Every rank holds one
    with the same arguments; ``group`` carries the small control messages (None: the default).

    ``transport``: ``disk`` (needs ``shared_dir``; ``keep_versions`` directories stay),
    ``tensor`` or ``distributed`` (``master_address``: the address the servers reach a source
    rank's update group at; None: the address of the source's own interface that routes to the
    first server; ``backend``: the groups' backend). ``timeout_s``: every HTTP call of a push
    (``rollout.request_timeout_s``: a large disk reload can take minutes). ``pause_mode``:
    ``abort`` or ``retract`` (``pipeline.engines.base.PAUSE_MODES``; SGLang's ``in_place``
    keeps the paused requests' KV, so SGLang refuses the flush the new weights need: refused
    here). ``engine``: the servers' engine (``pipeline.engines``: its control calls and its
    transports; default SGLang).
    """

    def __init__(self, server_urls: Sequence[str], *, transport: TransportName = "disk",
                 shared_dir: Optional[str | Path] = None, pause_mode: str = "abort",
                 timeout_s: float = 600.0, master_address: Optional[str] = None,
                 group_name: str = "megatron_gspo_weights", backend: Optional[str] = None,
                 keep_versions: int = 1, delta: bool = False, full_every: int = 10,
                 verify: bool | Literal["auto"] = "auto", group: Any = None,
                 quantization: Optional[str] = None, engine: Engine = SGLANG):
        if transport not in ("disk", "tensor", "distributed"):
            raise ValueError(f"transport {transport!r}: expected 'disk', 'tensor' or 'distributed'")
        modes = engine.control.pause_modes
        if pause_mode not in modes:
            raise ValueError(f"pause_mode {pause_mode!r}: expected one of {modes} (SGLang's "
                             "'in_place' keeps the paused requests' KV cache, so the flush after "
                             "the update is refused and they would continue on the old weights' KV)")
        if verify not in (True, False, "auto"):
            raise ValueError(f"verify {verify!r}: expected true, false or 'auto'")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        # The one choice of the transport (the engine's): nothing below asks which one it is.
        self.control = engine.control
        """The servers' control calls (``pipeline.engines.base.ServerControl``)."""
        self._transport: Transport = engine.make_transport(
            self, transport, shared_dir=shared_dir, keep_versions=keep_versions,
            group_name=group_name, master_address=master_address, backend=backend)
        if delta and not self._transport.supports_delta:
            raise ValueError("delta pushes need transport 'distributed' or 'tensor'")
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization {quantization!r}: expected None or 'fp8'")
        if delta and quantization:
            raise ValueError("delta pushes send bf16 bits; not with quantization fp8")
        if full_every < 1:
            raise ValueError(f"full_every: must be >= 1, got {full_every}")
        if not server_urls:
            raise ValueError("no rollout servers to push to")
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.transport = transport
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        self.delta, self.full_every, self.verify = delta, full_every, verify
        self.quantization = quantization
        """``fp8``: the servers run FP8 weights; every bucket's projections are sent as FP8
        blocks and scales (:mod:`pipeline.weights.fp8`)."""
        self.group = group
        self.tp: Optional[list[int]] = None
        """Per server, its TP size (``/server_info``, read at each push's start)."""
        self.verify_now = False
        """This push verifies checksums (negotiated)."""
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=_POOL_PER_SERVER * len(self.server_urls) + 4)
        self._infos: dict[str, dict] = {}  # url -> its /server_info (read once per server)
        self._ext: list[str] = []  # per server: the extensions this push negotiated ("" = none)
        self._said_unverified = False
        self._paused_at = 0.0  # rank 0: when this push paused the servers
        self.paused = PausedServers()
        """Rank 0: the servers this pusher has paused now (from before ``pause_generation`` until
        ``continue_generation`` answered); the server pool reads it
        (``pipeline.servers.paused``)."""
        self._base: dict[int, torch.Tensor] = {}  # delta: bucket index -> the bytes last sent
        self._pushes = 0
        self._last_ok: Optional[str] = None  # the version of the last successful push

    # ------------------------------------------------------------------ public
    def push(self, stream, version: str) -> SyncStats:
        """Collective: every rank passes its own stream of the same buckets."""
        t_start = time.perf_counter()
        version = str(version)
        rank = dist.get_rank()
        stats = SyncStats(weight_version=version, transport=self.transport,
                          num_tensors=stream.num_tensors, num_buckets=len(stream),
                          bytes=stream.total_bytes)
        # 1. pause, server info, full or delta
        begin = Outcome.of(self._begin, stream, stats) if rank == 0 else None
        shipped = broadcast(begin, self.group)
        begin = begin if begin is not None else shipped
        failure = begin.failure
        if failure is None:
            info = begin.value
            self.tp, full = info["tp"], info["full"]
            self._ext, self.verify_now = info["ext"], info["verify"]
            stats.delta = not full
            stats.phases.update(info["phases"])
        else:
            full = True
        # 2. what the transport needs before the first bucket (update groups: first push)
        if failure is None:
            failure = self._transport.connect(stream.sources, stats)
        # 3. the buckets (the trainer's checksum summed per tensor during the gather, in cache)
        if (failure is None and self.verify_now and hasattr(stream, "tensor_hook")
                and not self.quantization):  # FP8: the sums are of the quantized wire
            stream.tensor_hook = _tensor_sums
        mine: dict[int, dict] = {}  # bucket index -> {"checksum", "shard", "wire"}
        local = self._send_all(stream, version, full, mine, stats) if failure is None \
            else self._drain(stream)
        outcomes = all_gather((local, mine, stats.seconds_gather, stats.seconds_send),
                              self.group)
        if failure is None:  # the first rank's, in rank order
            failure = next((f for f, _, _, _ in outcomes if f is not None), None)
        buckets = {b: v for _, m, _, _ in outcomes for b, v in m.items()}
        stats.seconds_gather = max(o[2] for o in outcomes)
        stats.seconds_send = max(o[3] for o in outcomes)
        stats.wire_bytes = sum(v["wire"] for v in buckets.values())
        stats.verified_buckets = sum(v["verified"] for v in buckets.values())
        for v in buckets.values():  # the servers' own timings (local-server extension), summed
            for key, sec in (v.get("timings") or {}).items():
                stats.phases[f"server_{key}"] = stats.phases.get(f"server_{key}", 0.0) + sec
        # 4. load from disk / close the session, tag the version, flush, continue (rank 0)
        try:
            stats.verified_buckets, stats.phases = on_rank0(
                self._finish, version, buckets, stats, stream, begin.raised, failure,
                group=self.group)
        except Exception:  # the same error on every rank: the next push is a full one
            self._last_ok = None
            self._base.clear()
            raise
        self._pushes += 1
        self._last_ok = version
        stats.seconds_total = time.perf_counter() - t_start
        return stats

    def close(self) -> None:
        """Release what the transport holds (the update groups, server side first, then this
        rank's; the disk transport's spare directory - the versions it wrote stay)."""
        self._transport.close()
        self.pool.shutdown(wait=True)

    def set_servers(self, server_urls: Sequence[str], *, renewed: Sequence[str] = ()) -> None:
        """Push to ``server_urls`` from the next push on (``pipeline.servers.pool``: a dead server
        dropped, a restarted one back); ``renewed``: those of them that are new processes behind
        a known URL (restarted). Every rank passes the same lists (rank 0's). A change tears
        down the update groups (they are made again, with the new members, at the next push:
        the world size and the servers' rank offsets change, and a restarted server is in no
        group) and makes the next delta push a full one."""
        urls = [u.rstrip("/") for u in server_urls]
        if not urls:
            raise ValueError("no rollout servers to push to")
        if urls == self.server_urls and not renewed:
            return
        self._transport.reset()
        for url in set(self.server_urls) - set(urls) | {u.rstrip("/") for u in renewed}:
            self._infos.pop(url, None)
        self.server_urls, self.tp = urls, None
        self._last_ok = None
        self._base.clear()
        workers = _POOL_PER_SERVER * len(urls) + 4
        if workers > self.pool._max_workers:
            self.pool.shutdown(wait=True)
            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)

    # ------------------------------------------------------------------ for the transports
    def each_server(self, fn) -> list:
        """``fn(url)`` for every server, concurrently; the results in server order."""
        futures = [self.pool.submit(fn, url) for url in self.server_urls]
        return [f.result() for f in futures]

    def headers(self, server_index: int) -> Optional[dict]:
        """The negotiation header of a request to server ``server_index`` (None: plain SGLang)."""
        ext = self._ext[server_index] if server_index < len(self._ext) else ""
        return {EXTENSIONS_HEADER: ext} if ext else None

    def check(self, url: str, what: str, answer, expected: str) -> None:
        """Raise unless every TP rank's checksum of ``what`` in ``answer`` is ``expected``."""
        got = answer.get("checksums") if isinstance(answer, dict) else None
        if not got:
            raise ValueError(f"{url}: no checksum of {what} in the answer, although the server "
                             "offered checksums and the request negotiated them")
        bad = [i for i, c in enumerate(got) if c != expected]
        if bad:
            raise ValueError(f"{url}: {what}: checksum of TP rank(s) {bad} is {got[bad[0]]}, the "
                             f"trainer sent {expected}")

    # ------------------------------------------------------------------ steps 1 and 4 (rank 0)
    def _server_info(self, url: str) -> dict:
        """``/server_info`` of ``url``, read once (again after ``set_servers`` renews it)."""
        if url not in self._infos:
            self._infos[url] = self.control.server_info(url, timeout_s=self.timeout_s)
        return self._infos[url]

    def _negotiate(self, infos: list[dict]) -> tuple[list[str], bool]:
        """Per server, the extensions this push uses; whether it verifies checksums."""
        offered = [self.control.extensions(i) for i in infos]
        lacking = lambda ext: [u for u, o in zip(self.server_urls, offered) if ext not in o]  # noqa: E731
        if self.delta and lacking("delta"):
            raise ValueError(f"rollout.weight_sync.delta: {lacking('delta')} offer no delta pushes "
                             "(only the project's local rollout server does; SGLang has no delta "
                             "format): set rollout.weight_sync.delta: false")
        verify = bool(self.verify) and not lacking("checksums")
        if self.verify is True and not verify:
            raise ValueError(f"rollout.weight_sync.verify: {lacking('checksums')} cannot report "
                             "bucket checksums (only the project's local rollout server does): "
                             "set rollout.weight_sync.verify: auto or false")
        if self.verify == "auto" and not verify and not self._said_unverified:
            self._said_unverified = True
            msg = (f"weight sync: {lacking('checksums')} report no bucket checksums, so the "
                   "pushed weights are not verified (rollout.weight_sync.verify: auto)")
            log.warning(msg)
            print(msg, flush=True)
        ext = []
        for o in offered:
            use = [e for e in ("checksums", "delta", "timings")
                   if e in o and (e != "checksums" or verify) and (e != "delta" or self.delta)]
            ext.append(",".join(use))
        return ext, verify

    def _begin(self, stream, stats: SyncStats) -> dict:
        t0 = self._paused_at = time.perf_counter()
        self.paused.add(self.server_urls)
        self.each_server(lambda u: self.control.pause(u, self.pause_mode,
                                                      timeout_s=self.timeout_s))
        infos = self.each_server(self._server_info)
        phases = {"pause_s": time.perf_counter() - t0}
        tp = []
        for url, info in zip(self.server_urls, infos):
            self._transport.check_server(url, info)
            self._check_quantization(url, info)
            tp.append(int(info.get("tp_size") or 1))
        ext, verify = self._negotiate(infos)
        full = True
        if self.delta:
            if stream.dtype.itemsize != 2:
                raise ValueError(f"rollout.weight_sync.delta: needs 16-bit weights on the wire "
                                 f"(got {stream.dtype}); set rollout.weight_sync.dtype: bfloat16")
            versions = self.each_server(lambda u: self.control.weight_version(
                u, timeout_s=self.timeout_s))
            full = (self._pushes % self.full_every == 0 or self._last_ok is None
                    or any(v != self._last_ok for v in versions))
        self._transport.begin(stats.weight_version)
        return {"tp": tp, "full": full, "phases": phases, "ext": ext, "verify": verify}

    def _check_quantization(self, url: str, info: dict) -> None:
        """The server runs the weights this pusher sends: FP8 blocks and scales loaded into a
        server without FP8 weights (or bf16 into one with them) would be cast, not converted."""
        served = fp8_wire.server_quantization(info)
        if served != self.quantization:
            raise ValueError(
                f"{url}: rollout.quantization is {self.quantization or 'null'} but the server runs "
                f"{served or 'unquantized'} weights (its /server_info quantization); start the "
                "servers with --quantization fp8 from an FP8 checkpoint of the model (megatron-"
                "gspo convert hf-to-fp8) for rollout.quantization: fp8, without it otherwise")

    def _end(self, version: str, buckets: dict, stats: SyncStats, stream) -> None:
        self._transport.end(version, buckets, stats, stream)
        t0 = time.perf_counter()
        self.each_server(lambda u: self.control.set_version(u, version, timeout_s=self.timeout_s))
        # the cache holds KV of the old weights (the engine drops it: SGLang's flush_cache,
        # vLLM's reset_prefix_cache, which also recomputes requests paused in place)
        self.each_server(lambda u: self.control.after_update(u, self.pause_mode,
                                                             timeout_s=self.timeout_s))
        self.each_server(self._continue)
        stats.phases["flush_continue_s"] = time.perf_counter() - t0
        # what generation waited: from the pause request to the last server's continue
        stats.phases["paused_s"] = time.perf_counter() - self._paused_at

    def _continue(self, url: str) -> None:
        self.control.resume(url, timeout_s=self.timeout_s)
        self.paused.discard([url])

    def _finish(self, version: str, buckets: dict, stats: SyncStats, stream,
                raised: Optional[BaseException], failure: Optional[Failure]) -> tuple[int, dict]:
        """Rank 0, step 4: :meth:`_end` unless an earlier step failed (``failure``; ``raised``:
        the original error where it was raised on this rank); the push's verified buckets and
        phases. After a failure, :meth:`_recover`, then :class:`WeightPushError` naming it."""
        if failure is None:
            end = Outcome.of(self._end, version, buckets, stats, stream)
            failure, raised = end.failure, end.raised
        if failure is None:
            return stats.verified_buckets, stats.phases
        cause = raised if raised is not None else failure.error()
        raise WeightPushError(f"weight sync of version {version} to {self.server_urls} failed: "
                              f"{self._recover(one_line(cause))}", failure) from cause

    def _recover(self, error: str) -> str:
        """Rank 0, after a failed step: close the session, resume generation on every server that
        answers; returns ``error`` with what recovery could not do."""
        notes: list[str] = []
        self._transport.recover(notes)
        for url in self.server_urls:
            try:
                self.control.resume(url, timeout_s=min(self.timeout_s, 60))
            except rollout.RolloutError as err:
                notes.append(f"resuming generation failed: {err}")
            finally:
                self.paused.discard([url])
        tail = ("; generation resumed on every server (weights may be half-updated: the next "
                "push is a full one)") if not notes else "; " + "; ".join(notes)
        return error + tail

    # ------------------------------------------------------------------ step 3 (every rank)
    def _drain(self, stream) -> None:
        for _ in stream:  # keep the collective gather going on every rank
            pass
        return None

    def _send_all(self, stream, version: str, full: bool, mine: dict, stats: SyncStats
                  ) -> Optional[Failure]:
        """Iterate the stream; send this rank's buckets. Returns this rank's first failure (None
        also where it stopped sending because an earlier bucket, another source's, failed: that
        source reports it)."""
        rank = dist.get_rank()
        meta = stream.meta
        turns = self._transport.takes_turns
        failure: Optional[Failure] = None
        behind = False  # an earlier bucket (another source's) failed: send nothing more
        pending: list = []  # (index, finish) of buckets whose answers are not in

        def settle(keep: int) -> None:
            nonlocal failure
            while len(pending) > keep:
                index, finish = pending.pop(0)
                try:
                    mine[index] = finish()
                except Exception as err:  # noqa: BLE001 - reported like a send failure
                    if failure is None:
                        failure = failure_at(err, f"rank {rank}, bucket {index}")

        for bucket in stream:
            if bucket.source != rank:
                continue
            t0 = time.perf_counter()
            prev = meta[bucket.index - 1].source if bucket.index > 0 else rank
            if turns and prev != rank:  # wait for the previous bucket's source to finish
                token = torch.zeros(1, dtype=torch.int64)
                dist.recv(token, src=prev, group=self.group, tag=_TOKEN_TAG)
                behind = behind or bool(token.item())
            if failure is None and not behind:
                try:
                    pending.append((bucket.index, self._send_bucket(bucket, version, full)))
                except Exception as err:  # noqa: BLE001 - keep draining the gathers, then raise
                    failure = failure_at(err, f"rank {rank}, bucket {bucket.index}")
                # Every server's answer to this bucket before the next request leaves (from this
                # source or, through the token, the next): the order is the stream's by
                # construction, not by the timing of host threads (module docstring, step 3).
                settle(0)
            nxt = meta[bucket.index + 1].source if bucket.index + 1 < len(meta) else rank
            if turns and nxt != rank:
                dist.send(torch.tensor([int(failure is not None or behind)]), dst=nxt,
                          group=self.group, tag=_TOKEN_TAG)
            stats.seconds_send += time.perf_counter() - t0
        t0 = time.perf_counter()
        settle(0)
        stats.seconds_send += time.perf_counter() - t0
        stats.seconds_gather = getattr(stream, "seconds_waited", 0.0)
        return failure

    def _send_bucket(self, bucket, version: str, full: bool):
        """Send one bucket; returns ``finish()``, which waits for the servers' answers, checks
        their checksums and returns the bucket's entry. Everything that reads the bucket's
        buffer is done when this returns (the gather reuses it for a later bucket)."""
        named = bucket.named_tensors()
        parts = getattr(bucket, "parts", None)
        wire, wire_flat, is_delta = named, bucket.flat[: bucket.nbytes], False
        if self.quantization:  # what the servers hold is the FP8 blocks and scales sent
            wire = fp8_wire.fp8_entries(named)
            wire_flat, parts = self._as_flat(wire), None
        if not self.verify_now:
            checksum = None
        elif parts is not None and len(parts) == len(bucket.names):
            checksum = _Done(wt.checksum_digest(parts))
        else:
            checksum = self.pool.submit(wt.bucket_checksum, wire)
        entry = {"shard": None, "wire": bucket.nbytes, "verified": 0, "checksum": None,
                 "names": [n for n, _ in wire] if self.quantization else None}
        if self.delta:
            base = self._base.get(bucket.index)
            if not full and base is not None:
                wire, is_delta = self._delta_entries(bucket, base), True
                wire_flat = self._as_flat(wire)
        extra = {"delta": True} if is_delta else {}
        answers = self._transport.send(bucket, version, wire, wire_flat, extra, entry)
        entry["wire"] = int(wire_flat.numel())
        expected = checksum.result() if checksum is not None else None
        if answers is None:  # the servers answer at the end (disk): checked there
            entry["checksum"] = expected
            return lambda: entry
        if self.delta:  # what the server will hold (a failed push drops every base)
            base = self._base.get(bucket.index)
            if base is None:
                self._base[bucket.index] = bucket.flat[: bucket.nbytes].clone()
            else:
                base.copy_(bucket.flat[: bucket.nbytes])

        def finish() -> dict:
            got = [a.result() if isinstance(a, concurrent.futures.Future) else a for a in answers]
            timings = [a.get("timings") for a in got if isinstance(a, dict) and a.get("timings")]
            if timings:  # the slowest server's, per phase
                entry["timings"] = {k: max(float(t.get(k, 0.0)) for t in timings)
                                    for k in timings[0]}
            if expected is not None:
                entry["checksum"] = expected
                for url, answer in zip(self.server_urls, got):
                    self.check(url, f"bucket {bucket.index}", answer, expected)
                entry["verified"] = 1
            return entry
        return finish

    def _delta_entries(self, bucket, base: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The bucket as deltas against ``base`` where smaller; int32 entries first, so every
        entry of the flattened wire bucket is aligned to its item size."""
        old = dict(wt.unflatten(base, wt.flat_layout(bucket.names, [bucket.dtype] * len(bucket.names),
                                                      bucket.shapes)[0]))
        wide, narrow = [], []
        for name, new in bucket.named_tensors():
            enc = wt.delta_encode(name, new, old[name])
            if enc is None:
                narrow.append((name, new))
            else:
                wide.append(enc[0])
                narrow.append(enc[1])
        return wide + narrow

    @staticmethod
    def _as_flat(named) -> torch.Tensor:
        return torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named]) if len(named) > 1 \
            else named[0][1].reshape(-1).view(torch.uint8)
