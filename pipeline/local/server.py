"""The local rollout server's HTTP side: SGLang's native API over :class:`LocalEngine`.

Started by ``megatron-gspo serve`` (``launch/serve.py``). By default it enforces what SGLang 0.5.23
enforces (each rule checked against the wheel by ``tests/rollout/test_server_conformance.py``):

* only SGLang's paths (``@app`` routes of its http_server.py); anything else is a 404 (``/get_load``
  too; ``/metrics`` only with ``--enable-metrics``);
* control bodies are ``io_struct``'s request classes: every field accepted with SGLang's default
  (``protocol.CONTROL_REQUESTS``), unknown fields ignored, a missing or mistyped one a 400;
* weight-update sessions: ``update_weights_from_tensor`` / ``_distributed`` only between
  ``begin_weight_update`` and ``end_weight_update`` (SGLang's messages); disk updates need none;
* ``/flush_cache`` is refused (400 ``Flush cache failed.``) unless ``is_fully_idle(ignore_waiting=
  paused)``: nothing running, and nothing waiting unless the engine is paused (``in_place`` keeps
  running requests with their KV, so it is refused; after ``retract`` or ``abort`` it works);
  ``?timeout=`` waits as SchedulerFlushWrapper does;
* every update flushes after a successful load (``flush_cache`` defaults to true); a refused flush
  makes the update answer failure with SGLang's "Weights were updated, but the cache was not
  flushed ..." (the weights and the engine's version did change; ``/model_info``'s version not);
* an update to an unpaused server takes SGLang's model-update writer lock: it waits for every
  in-flight generate (each holds the reader lock) and holds new ones back; paused, it runs at once;
* a prefix cache as SGLang's radix cache (``engine.PrefixCache``; ``--disable-radix-cache`` turns
  it off, ``--radix-cache-max-tokens`` bounds it): ``meta_info.cached_tokens`` is the number of
  prompt tokens it served, ``cached_tokens_details`` ``{"device": n, "host": 0}`` (None without a
  hit); a request with ``n > 1`` first sends its prompt alone with ``max_new_tokens`` 0, as
  SGLang's TokenizerManager does, so its samples find it cached; an accepted flush (and so every
  weight update with ``flush_cache: true``) and ``release_memory_occupation`` empty it;
* pause modes: ``abort`` aborts until no generate is left, ``in_place`` holds requests with their
  KV, ``retract`` sends running requests back to the waiting queue, recomputed (prompt + output so
  far re-prefilled) on the weights of the time after ``continue_generation``;
* ``meta_info.weight_versions`` / ``weight_version`` exactly as 0.5.23 builds them
  (``engine.compute_weight_version_spans`` / ``add_weight_versions_to_meta_info``);
  ``update_weight_version`` aborts every request unless ``abort_all_requests: false``;
* data-parallel layout (``--dp-size``, ``--attn-dp-size``, ``--enable-dp-attention``, resolved as
  ``handle_deprecated_dp_attention`` does and reported in ``/server_info``): with replicas
  (``dp_size > 1``) tensor / distributed updates and update groups are SGLang's failed assert (a
  plain 500 ``Internal Server Error``), disk updates work, and answers are merged over the DP
  ranks as SGLang merges them (``" | "``). The server itself always computes as ONE replica,
  whatever layout it reports.

Extensions, used only by a request that negotiates them with the header
``X-Megatron-Gspo-Extensions: checksums,delta,timings`` (any subset; ``/server_info`` lists those
offered in ``megatron_gspo_extensions``, none with ``--no-extensions``): per-bucket ``checksums``
(per TP rank; per shard file for disk updates) and the server's ``timings`` (``receive_s``,
``load_s``) in weight-update answers, and ``"delta": true`` bf16 deltas. Without the header the
answer is SGLang's body and ``delta`` is an ignored unknown field.

Other deviations (all documented in docs/rollout.md):

* ``update_weights_from_tensor`` takes SGLang's pickled payloads (shared-memory handles) only with
  ``--allow-pickled-tensors`` on 127.0.0.1, else base64 safetensors (:mod:`pipeline.weights.transport`);
* ``init_weights_update_group`` / ``update_weights_from_distributed`` run over gloo (CPU), with
  SGLang's own group code when the ``sglang`` package is importable; ``--tp-size N`` joins N group
  ranks (:mod:`pipeline.local.tp_ranks`); ``/server_info`` also has ``weight_sync_impl`` and
  ``allow_pickled_tensors``;
* weight updates land in place: ``update_weights_from_distributed`` receives into two reused
  buffers laid out by SGLang's ``FlattenedTensorBucket`` (no fresh allocation per bucket), the
  trainer's shared-memory buckets stay mapped (``tp_ranks.MappedStorages``), disk shards are
  ``readinto`` the parameters; each weight is checksummed right after it is written;
* ``/weights_checker {"action": "checksum"}`` returns :func:`weights_checksum` (sha256 over the HF
  names, dtypes, shapes and bytes), not SGLang's per-engine digest;
* ``keep_pause``, ``is_async``, ``token_step``, ``manifest``, ``recapture_cuda_graph``,
  ``torch_empty_cache`` of the update bodies are accepted and have no effect (0.5.23 reads
  ``keep_pause`` and ``is_async`` nowhere; a disk update never changes the pause state).

Limits (a request must not be able to take the server down: ``n: 1000000`` once OOM-killed it):

* ``--max-n``: ``sampling_params.n`` above it is a 400 ``{"error": {"message": ...}}`` (SGLang's
  ValueError shape; SGLang itself has no such limit);
* ``--max-queued-requests`` (SGLang's flag): a request whose samples do not fit in the waiting
  queue is a 503 ``{"detail": "The request queue is full."}``, SGLang's answer when its
  ``--max-queued-requests`` is reached (before anything is queued; a streamed request gets the
  same 503 instead of SGLang's aborted stream);
* ``--max-request-mb`` / ``--max-weight-update-mb`` (the weight-carrying
  ``update_weights_from_tensor`` / ``_distributed``): a larger body is a 413 in SGLang's
  HTTPException shape, from its Content-Length before it is read, or as soon as a chunked body
  passes the limit (:class:`BodyLimit`; SGLang reads any size);
* ``--max-json-depth``: deeper JSON is a 400 (the HTTPException shape, FastAPI's "There was an
  error parsing the body", SGLang's answer when its parser gives up), checked on the bytes
  before parsing (:func:`json_depth_exceeds`), never a 500;
* ``update_weights_from_disk`` loads only from the served model's directory and the
  ``--weight-roots`` directories (paths resolved, symlinks followed), each shard named by the
  index a plain file of the directory; every header is checked against its file first, so a
  malformed index or a truncated shard is a ``{"success": false}`` answer that changes nothing;
* ``init_weights_update_group`` joins a group at ``rank_offset >= 1`` only: rank 0 hosts the
  group's TCP store, and that is the trainer's (a server never opens a store).
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import dataclasses
import ipaddress
import json
import logging
import re
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pipeline.generation import routed_experts
from pipeline.weights import transport as wt
from pipeline.local import protocol as proto
from pipeline.local.engine import LocalEngine
from pipeline.local.request import (QUEUE_FULL, EngineRequest, QueueFull,
                                    add_weight_versions_to_meta_info)
from pipeline.local.weight_table import WeightFileError, shard_headers
from pipeline.local.tp_ranks import (MappedStorages, ReceiveBuffers, TPWorkers, join_group, receive,
                                     sglang_impl)
from pipeline.weights.transport import decode_named_tensors

log = logging.getLogger("megatron_gspo.serve")

PROTOCOL_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this server follows
DEFAULT_MAX_N = 1024  # --max-n
DEFAULT_MAX_QUEUED = 4096  # --max-queued-requests (SGLang's default: unbounded)
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
DEFAULT_MAX_REQUEST_MB = 32  # --max-request-mb (SGLang: unbounded)
DEFAULT_MAX_WEIGHT_UPDATE_MB = 4096  # --max-weight-update-mb (SGLang: unbounded)
DEFAULT_MAX_JSON_DEPTH = 64  # --max-json-depth (SGLang: Python's recursion limit, ~1000)
WEIGHT_UPDATE_PATHS = frozenset({"/update_weights_from_tensor", "/update_weights_from_distributed"})
"""Paths whose bodies may carry weights (base64 safetensors buckets, per-tensor name / dtype /
shape lists): limited by --max-weight-update-mb instead of --max-request-mb."""
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n")
# SGLang 0.5.23's answers (entrypoints/http_server.py, scheduler_components/flush_wrapper.py,
# scheduler_components/weight_updater.py), checked against the wheel by
# tests/rollout/test_server_conformance.py
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_BUSY = "Another flush_cache is already in progress."
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
FLUSH_REFUSED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache.")
SESSION_ALREADY_OPEN = ("a weight-update session is already open; call end_weight_update() "
                        "first")
NO_SESSION_OPEN = "no weight-update session is open; call begin_weight_update() first"
OUTSIDE_SESSION = "{} must run between begin_weight_update() and end_weight_update()"

EXTENSIONS = ("checksums", "delta", "timings")
"""This server's extensions of SGLang's protocol, offered in ``/server_info``
(``megatron_gspo_extensions``) unless started with ``--no-extensions``."""
EXTENSIONS_HEADER = "X-Megatron-Gspo-Extensions"
"""A request's negotiated extensions (comma-separated); without it a request is plain SGLang."""
IMPLEMENTATION = "megatron-gspo local rollout server"


def cached_tokens_details(cached_tokens: int) -> Optional[dict]:
    """``meta_info.cached_tokens_details`` as 0.5.23 fills it without a hierarchical cache
    (``SchedulerOutputStreamer.get_cached_tokens_details``, put in meta_info by the
    TokenizerManager whenever the batch carries the list): None without a cache hit, else the
    hit, all of it from the device tier."""
    return {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None


def resolve_dp_layout(dp_size: int, attn_dp_size: int, enable_dp_attention: bool,
                      tp_size: int) -> tuple[int, int]:
    """(dp_size, attn_dp_size) as SGLang 0.5.23 resolves its flags: ``handle_deprecated_dp_attention``
    (srt/arg_groups/parallel_hook.py) turns ``--enable-dp-attention --dp-size N`` into
    ``attn_dp_size = N, dp_size = 1``; then its checks (``_handle_data_parallelism``)."""
    if enable_dp_attention and attn_dp_size == 1:
        attn_dp_size, dp_size = dp_size, 1
    if dp_size < 1:
        raise ValueError(f"--dp-size must be positive (got {dp_size}).")
    if attn_dp_size < 1:
        raise ValueError(f"--attn-dp-size must be positive (got {attn_dp_size}).")
    if attn_dp_size > 1 and dp_size > 1:
        raise ValueError(f"--dp-size {dp_size} with --attn-dp-size {attn_dp_size}: "
                         "data-parallel replicas combined with attention data parallelism "
                         "are not supported.")
    if tp_size % attn_dp_size:
        raise ValueError(f"--attn-dp-size {attn_dp_size}: tp_size {tp_size} must be divisible "
                         "by it")
    return dp_size, attn_dp_size


class RWLock:
    """SGLang's ``sglang.srt.utils.aio_rwlock.RWLock`` (the TokenizerManager's
    ``model_update_lock``): readers share it, a writer waits for every reader, and a waiting
    writer holds new readers back."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer_active = False
        self._waiting_writers = 0

    async def acquire_reader(self) -> None:
        async with self._cond:
            while self._writer_active or self._waiting_writers > 0:
                await self._cond.wait()
            self._readers += 1

    async def release_reader(self) -> None:
        async with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    async def is_locked(self) -> bool:
        async with self._cond:
            return self._writer_active or self._readers > 0

    def writer(self):
        lock = self

        class _Writer:
            async def __aenter__(self):
                async with lock._cond:
                    lock._waiting_writers += 1
                    try:
                        while lock._writer_active or lock._readers > 0:
                            await lock._cond.wait()
                        lock._writer_active = True
                    finally:
                        lock._waiting_writers -= 1

            async def __aexit__(self, *exc):
                async with lock._cond:
                    lock._writer_active = False
                    lock._cond.notify_all()
        return _Writer()


def _arg(args, name: str, default):
    """``args.name``, ``default`` when absent or None (never for 0: ``--tp-size 0`` is an error,
    not 1)."""
    value = getattr(args, name, None)
    return default if value is None else value


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _json(content: Any, status: int = 200):
    return JSONResponse(content=content, status_code=status)


def http_error_body(status: int, message: str) -> dict:
    """SGLang's answer to an ``HTTPException`` (its handler in http_server.py: ``ErrorResponse``
    with ``type`` the status code as a string)."""
    return {"object": "error", "message": message, "type": str(status), "param": None,
            "code": status}


class TooDeep(ValueError):
    """A JSON body nested deeper than ``--max-json-depth`` (HTTP 400)."""


_BRACKETS_ONLY = bytes(c for c in range(256) if c not in b"[]{}")
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether the JSON text ``raw`` nests arrays / objects deeper than ``limit`` (checked on the
    bytes, before parsing: nothing recursive runs on them). Linear, in bounded extra memory."""
    import numpy as np

    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # cannot be deeper (every weight-update body: a few brackets)
    if b"\\" in raw:  # escapes: strings matched properly
        outside = _JSON_STRING.sub(b"", raw)
    else:  # every quote opens or closes a string
        outside = b"".join(raw.split(b'"')[0::2])
    brackets = outside.translate(None, _BRACKETS_ONLY)
    depth, step = 0, 1 << 20
    for start in range(0, len(brackets), step):
        a = np.frombuffer(brackets, np.uint8, count=min(step, len(brackets) - start),
                          offset=start)
        running = np.cumsum(np.where((a == 91) | (a == 123), 1, -1)) + depth
        if int(running.max()) > limit:
            return True
        depth = int(running[-1])
    return False


async def _body(request, *, required: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise proto.ParseError("a JSON body is required")
        return {}
    limit = getattr(request.app.state, "max_json_depth", DEFAULT_MAX_JSON_DEPTH)
    if json_depth_exceeds(raw, limit):
        raise TooDeep(f"There was an error parsing the body: JSON nested deeper than this "
                      f"server's --max-json-depth {limit}")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as err:
        raise proto.ParseError(f"JSON decode error: {err}") from None
    except RecursionError:  # only with a --max-json-depth near Python's recursion limit
        raise TooDeep(f"There was an error parsing the body: JSON nested too deeply "
                      f"(--max-json-depth {limit})") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise proto.ParseError("the request body must be a JSON object")
    return body


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request body over its path's limit is a 413, decided before the body is
    read: from ``Content-Length`` at once, and for a chunked body as soon as the bytes received
    pass the limit (the rest is never read; the connection is closed). Weight-update paths
    (:data:`WEIGHT_UPDATE_PATHS`) have their own, larger limit."""

    def __init__(self, app, max_bytes: int, max_weight_bytes: int):
        self.app = app
        self.max_bytes, self.max_weight_bytes = int(max_bytes), int(max_weight_bytes)

    def _limit(self, path: str) -> tuple[int, str]:
        if path in WEIGHT_UPDATE_PATHS:
            return self.max_weight_bytes, "--max-weight-update-mb"
        return self.max_bytes, "--max-request-mb"

    @staticmethod
    async def _refuse(send, size: str, limit: int, flag: str) -> None:
        body = json.dumps(http_error_body(413, (
            f"Request body too large: {size} bytes, over this server's limit of {limit} bytes "
            f"for this path ({flag} {limit >> 20})"))).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, flag = self._limit(scope.get("path", ""))
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None:
            try:
                too_large = int(declared) > limit
            except ValueError:
                too_large = False  # the server (h11 / httptools) refuses it itself
            if too_large:
                return await self._refuse(send, declared.decode(), limit, flag)
        received = 0
        started = False

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge()
            return message

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if started:
                raise
            await self._refuse(send, f"more than {limit}", limit, flag)


class LocalRolloutServer:
    """FastAPI app + engine. ``args``: the parsed ``megatron-gspo serve`` namespace."""

    def __init__(self, args):
        self.args = args
        self.tp_size = int(_arg(args, "tp_size", 1))
        if self.tp_size < 1:
            raise ValueError(f"--tp-size: must be >= 1, got {self.tp_size}")
        self.args_allow_pickle = bool(getattr(args, "allow_pickled_tensors", False))
        if self.args_allow_pickle and not _is_loopback(args.host):
            raise ValueError(f"--allow-pickled-tensors: only with --host 127.0.0.1 (got "
                             f"{args.host}): deserialising a pickle runs code, so such payloads "
                             "must never come from the network")
        self.max_request_bytes = int(_arg(args, "max_request_mb", DEFAULT_MAX_REQUEST_MB)
                                     * (1 << 20))
        self.max_weight_update_bytes = int(
            _arg(args, "max_weight_update_mb", DEFAULT_MAX_WEIGHT_UPDATE_MB) * (1 << 20))
        self.max_json_depth = int(_arg(args, "max_json_depth", DEFAULT_MAX_JSON_DEPTH))
        if min(self.max_request_bytes, self.max_weight_update_bytes, self.max_json_depth) < 1:
            raise ValueError("--max-request-mb / --max-weight-update-mb / --max-json-depth: "
                             "must be positive")
        self.max_n = int(getattr(args, "max_n", DEFAULT_MAX_N))
        max_queued = getattr(args, "max_queued_requests", DEFAULT_MAX_QUEUED)
        if self.max_n < 1 or (max_queued is not None and max_queued < 1):
            raise ValueError(f"--max-n {self.max_n} / --max-queued-requests {max_queued}: "
                             "must be >= 1")
        self.engine = LocalEngine(
            args.model_path, random_seed=args.random_seed,
            max_running_requests=args.max_running_requests,
            max_prefill_tokens=args.max_prefill_tokens, context_length=args.context_length,
            weight_version=args.weight_version, skip_tokenizer_init=args.skip_tokenizer_init,
            dtype=args.dtype, max_queued_requests=max_queued,
            capture_routed_experts=bool(getattr(args, "enable_return_routed_experts", False)),
            device=getattr(args, "device", "cpu"),
            radix_cache=not getattr(args, "disable_radix_cache", False),
            radix_cache_max_tokens=getattr(args, "radix_cache_max_tokens", None))
        self.weight_roots = [self.engine.model_path] + [
            Path(r).resolve() for r in (getattr(args, "weight_roots", None) or [])]
        """Directories update_weights_from_disk may read (resolved): the model's and
        --weight-roots."""
        self.startup_time = time.time()
        self.extensions = [] if getattr(args, "no_extensions", False) else list(EXTENSIONS)
        """The extensions offered (``--no-extensions``: none, every request is plain SGLang)."""
        self.dp_size, self.attn_dp_size = resolve_dp_layout(
            int(_arg(args, "dp_size", 1)), int(_arg(args, "attn_dp_size", 1)),
            bool(getattr(args, "enable_dp_attention", False)), self.tp_size)
        self.num_dp_ranks = self.dp_size * self.attn_dp_size  # SGLang's num_dp_ranks_of
        self.enable_metrics = bool(getattr(args, "enable_metrics", False))
        self.reported_weight_version = str(args.weight_version)
        """The TokenizerManager's weight version (``/model_info``, ``meta_info.weight_version``
        of unfinished chunks); the engine's (the scheduler's) moves first, this one only when
        the update answered success."""
        self.reported_model_path = str(self.engine.model_path)  # moved by a disk update
        self.reported_load_format = "auto"
        self._session: Optional[str] = None  # the open weight-update session's selector
        self._rw = RWLock()  # model_update_lock: generates read, unpaused updates write
        self._pause_lock = asyncio.Lock()  # SGLang's is_pause_cond
        self._flush_pending = False
        self.paused = False
        self.shutting_down = False
        self._not_paused: Optional[asyncio.Event] = None
        self._groups: dict[str, Any] = {}  # group_name -> rank 0's update group
        self._group_lock = threading.Lock()
        self.impl = sglang_impl()  # SGLang's own weight-update code where it is installed
        self._receive_buffers = ReceiveBuffers(2)  # bucket k loads while bucket k+1 arrives
        self._mapped = MappedStorages()  # the trainer's shared-memory buckets stay mapped
        self.tp_workers = TPWorkers(self.tp_size, args.model_path, args.dtype)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * self.tp_size + 2)
        self.app = self._build_app()
        if getattr(args, "fault_perturb_weights", 0.0):  # tests of the parity watchdog only
            from pipeline.local import fault_injection

            fault_injection.install(self.app, self.engine, args.fault_perturb_weights,
                                    seed=args.random_seed or 0)
        # added last: the outermost middleware (the fault injection's wraps the app's streams)
        self.app.state.max_json_depth = self.max_json_depth
        self.app.add_middleware(BodyLimit, max_bytes=self.max_request_bytes,
                                max_weight_bytes=self.max_weight_update_bytes)

    def shutdown(self) -> None:
        """Stop the engine thread and the TP rank processes."""
        self.shutting_down = True
        self.engine.stop()
        self.tp_workers.stop()
        self._pool.shutdown(wait=False)

    # ------------------------------------------------------------------ helpers
    def _confined(self, path: Path) -> bool:
        real = path.resolve()
        return any(real == root or root in real.parents for root in self.weight_roots)

    def _check_weight_dir(self, model_path: str) -> dict:
        """The validated shard headers of ``model_path`` (``engine.shard_headers``), every file
        inside the allowed roots; :class:`WeightFileError` / ``OSError`` saying why not."""
        path = Path(model_path)
        roots = ", ".join(str(r) for r in self.weight_roots)
        if not self._confined(path):
            raise WeightFileError(f"{model_path}: outside the directories this server loads "
                                  f"weights from ({roots}); start it with --weight-roots DIR")
        headers = shard_headers(path)
        for f in headers:
            if not self._confined(path / f):
                raise WeightFileError(f"{path / f}: resolves to {(path / f).resolve()}, outside "
                                      f"the directories this server loads weights from ({roots})")
        return headers

    def _loop_event(self) -> asyncio.Event:
        if self._not_paused is None:
            self._not_paused = asyncio.Event()
            if not self.paused:
                self._not_paused.set()
        return self._not_paused

    def _response(self, r: EngineRequest, prompt_len: int, call: proto.GenerateCall,
                  item: proto.ItemSpec) -> dict:
        eng = self.engine
        meta: dict[str, Any] = {"id": r.rid, "finish_reason": r.finish}
        queued_abort = r.finish.get("message") == "Abort in waiting queue"
        text_lp = call.return_text_in_logprobs and eng.tokenizer is not None

        def triple(lp, tok):
            return [lp, tok, eng.decode([tok], skip_special_tokens=False) if text_lp else None]

        if not queued_abort:
            meta["prompt_tokens"] = prompt_len
        meta["weight_version"] = self.reported_weight_version  # the TokenizerManager's
        if not queued_abort:
            meta["num_retractions"] = r.num_retractions
        if item.return_logprob:
            if r.input_logprobs is None:
                meta["input_token_logprobs"] = []
            else:
                start = len(r.input_ids) - len(r.input_logprobs)
                meta["input_token_logprobs"] = [triple(lp, r.input_ids[start + j])
                                                for j, lp in enumerate(r.input_logprobs)]
            meta["output_token_logprobs"] = [triple(lp, tok) for lp, tok in
                                             zip(r.output_logprobs, r.output_ids)]
            meta["output_token_logprobs_length"] = len(r.output_ids)
            if item.top_logprobs_num > 0:
                meta["input_top_logprobs"] = [
                    None if row is None else [triple(lp, t) for lp, t in row]
                    for row in (r.input_top or [])]
                meta["output_top_logprobs"] = [[triple(lp, t) for lp, t in row]
                                               for row in r.output_top]
        meta["completion_tokens"] = len(r.output_ids)
        if not queued_abort:
            meta["reasoning_tokens"] = 0
            meta["cached_tokens"] = r.cached_tokens
        # SGLang 0.5.23: the scheduler's compute_weight_version_spans at finish, turned into
        # "weight_versions" (and the last visible "weight_version") by the TokenizerManager
        add_weight_versions_to_meta_info(meta, r.weight_version_spans, len(r.output_ids))
        if not queued_abort:
            meta["cached_tokens_details"] = cached_tokens_details(r.cached_tokens)
        if not queued_abort:
            meta["dp_rank"] = 0
        meta["e2e_latency"] = r.e2e_latency
        if not queued_abort:
            meta["response_sent_to_client_ts"] = time.time()
        if r.return_routed_experts and eng.capture_routed_experts and not queued_abort:
            # SGLang: base64 of the int32 [seqlen - 1 - start, layers, top_k] bytes; only with
            # --enable-return-routed-experts (without it the key is absent), never while queued
            meta["routed_experts"] = routed_experts.encode(eng.routed_experts(r))
        out: dict[str, Any] = {}
        if eng.tokenizer is not None:
            out["text"] = self._text(r)
        out["output_ids"] = list(r.output_ids)
        out["meta_info"] = meta
        if call.return_prompt_token_ids:
            out["prompt_token_ids"] = list(r.input_ids)
        return out

    def _text(self, r: EngineRequest) -> str:
        s, ids = r.sampling, list(r.output_ids)
        matched = (r.finish or {}).get("matched") if (r.finish or {}).get("type") == "stop" else None
        if isinstance(matched, int) and not s.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.engine.decode(ids, skip_special_tokens=s.skip_special_tokens) or ""
        if isinstance(matched, str) and matched in text:
            cut = text.index(matched)
            text = text[: cut + len(matched)] if s.no_stop_trim else text[:cut]
        return text

    def _expand(self, call: proto.GenerateCall, notify) -> list[tuple[EngineRequest, proto.ItemSpec, int]]:
        expanded = []
        for item in call.items:
            ids = item.input_ids if item.input_ids is not None else self.engine.encode(item.text)
            if not ids:
                raise ValueError("input_ids cannot be empty.")
            proto.check_routed_experts_start_len(call, len(ids))
            n = item.sampling.n
            for s in range(n):
                rid = item.rid if n == 1 else uuid.uuid4().hex
                req = EngineRequest(rid, ids, item.sampling, return_logprob=item.return_logprob,
                                    logprob_start_len=item.logprob_start_len,
                                    top_logprobs_num=item.top_logprobs_num,
                                    return_routed_experts=call.return_routed_experts,
                                    routed_experts_start_len=call.routed_experts_start_len)
                expanded.append((req, item, len(ids)))
        for index, (req, _, _) in enumerate(expanded):
            req.on_event = notify(index, req)
        return expanded

    # ------------------------------------------------------------------ app
    def _build_app(self):
        app = FastAPI(title="megatron-gspo local rollout server")
        eng = self.engine

        def error_response(err: Exception):
            if isinstance(err, TooDeep):  # SGLang: FastAPI's HTTPException(400) for a body
                return _json(http_error_body(400, str(err)), 400)  # json.loads cannot parse
            if isinstance(err, proto.ParseError):
                return _json(proto.parse_error_body(str(err)), 400)
            if isinstance(err, proto.ContractError):
                return _json(proto.contract_error_body(str(err)), 400)
            return _json(proto.value_error_body(str(err)), 400)

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request):
            try:
                body = await _body(request, required=True)
                call = proto.parse_generate(body)
                n = call.items[0].sampling.n
                if n > self.max_n:
                    raise ValueError(f"n: {n} samples per prompt exceed this server's --max-n "
                                     f"{self.max_n}; send fewer per request")
            except ValueError as err:
                return error_response(err)
            limit = eng.max_queued_requests
            if limit is not None and len(call.items) * n > limit - eng.counts()[1]:
                return _json({"detail": QUEUE_FULL}, 503)  # before creating any request
            await self._loop_event().wait()  # pause_generation: new generates block
            # SGLang holds the model-update reader lock from sending the request to its last
            # answer: an update to an unpaused server (the writer) waits for every generate
            await self._rw.acquire_reader()
            released = False

            async def release():
                nonlocal released
                if not released:
                    released = True
                    await self._rw.release_reader()
            response = None
            try:
                response = await submit_and_answer(request, call, release)
                return response
            finally:
                if not isinstance(response, StreamingResponse):  # a stream releases at its end
                    await release()

        async def warm_prefixes(request, expanded):
            """SGLang's parallel sampling (``n > 1``, TokenizerManager ``_handle_batch_request``):
            each prompt first goes alone with ``max_new_tokens`` 0 ("Cache the common prefix for
            parallel sampling"), answered before its samples are sent, so each sample finds
            ``len(input_ids) - 1`` of its tokens in the prefix cache. The warm-up has a fresh rid
            and a fixed seed (it samples nothing, so it draws nothing from ``--random-seed``'s
            stream). Returns a response only when the client went away (499)."""
            if eng.prefix_cache is None:
                return None  # nothing to warm (SGLang still sends it; the tree drops it)
            prompts = {}
            for r, item, _ in expanded:
                if item.sampling.n > 1 and id(item) not in prompts:
                    prompts[id(item)] = (r.input_ids, item.sampling)
            if not prompts:
                return None
            loop = asyncio.get_running_loop()
            done: asyncio.Queue = asyncio.Queue()

            def on_event(kind: str) -> None:
                if kind == "finish":
                    loop.call_soon_threadsafe(done.put_nowait, kind)
            warm = [EngineRequest(uuid.uuid4().hex, ids,
                                  dataclasses.replace(sampling, max_new_tokens=0, n=1,
                                                      sampling_seed=0), on_event=on_event)
                    for ids, sampling in prompts.values()]
            eng.submit(warm)
            if not await all_finished(request, done, [r.rid for r in warm]):
                return Response(status_code=499)
            return None

        async def all_finished(request, events: asyncio.Queue, rids: list[str]) -> bool:
            """Wait for one event per request in ``rids`` on ``events``; False (every one of them
            aborted) if the client went away first."""
            remaining = len(rids)
            while remaining:
                try:
                    await asyncio.wait_for(events.get(), timeout=1.0)
                    remaining -= 1
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # the client gave up: free the batch
                        for rid in rids:
                            eng.abort(rid)
                        return False
            return True

        async def submit_and_answer(request, call, release):
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            def notify(index, req):
                def on_event(kind: str) -> None:
                    if kind == "finish" or call.stream:
                        loop.call_soon_threadsafe(queue.put_nowait, (index, kind))
                return on_event

            try:
                expanded = self._expand(call, notify)
                warmed = await warm_prefixes(request, expanded)
                if warmed is not None:
                    return warmed
                eng.submit([r for r, _, _ in expanded])
            except ValueError as err:
                return error_response(err)
            except QueueFull:
                return _json({"detail": QUEUE_FULL}, 503)
            except RuntimeError as err:
                return _json(proto.value_error_body(str(err)), 503)
            if call.stream:
                return StreamingResponse(self._stream(request, call, expanded, queue, release),
                                         media_type="text/event-stream")
            if not await all_finished(request, queue, [r.rid for r, _, _ in expanded]):
                return Response(status_code=499)
            bodies = [self._response(r, plen, call, item) for r, item, plen in expanded]
            return _json(bodies if call.is_batch else bodies[0])

        @app.get("/health")
        @app.get("/health_generate")
        async def health():
            if self.shutting_down or not eng.alive:
                return Response(status_code=503)
            running, waiting = eng.counts()
            if self.paused or running or waiting:
                return Response(status_code=200)
            loop = asyncio.get_running_loop()
            done = asyncio.Event()
            req = EngineRequest(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0],
                                proto.parse_sampling({"max_new_tokens": 1, "temperature": 0.0}),
                                on_event=lambda kind: kind == "finish" and loop.call_soon_threadsafe(done.set))
            try:
                eng.submit([req])
                await asyncio.wait_for(done.wait(), HEALTH_TIMEOUT_S)
            except (ValueError, RuntimeError, asyncio.TimeoutError):
                eng.abort(req.rid)
                return Response(status_code=503)
            return Response(status_code=200)

        @app.get("/ready")
        async def ready():
            return Response(status_code=200 if eng.alive and not self.shutting_down else 503)

        def model_info():
            return {  # model_path / served_model_name / load_format: moved by a disk update
                "model_path": self.reported_model_path,
                "served_model_name": self.reported_model_path,
                "tokenizer_path": str(eng.model_path), "is_generation": True,
                "preferred_sampling_params": None, "weight_version": self.reported_weight_version,
                "load_format": self.reported_load_format, "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(eng.config, "model_type", None),
                "architectures": getattr(eng.config, "architectures", None),
            }

        app.get("/model_info")(model_info)
        app.get("/get_model_info")(model_info)

        def server_info():
            a = self.args
            running, waiting = eng.counts()
            return {
                "model_path": str(eng.model_path), "tokenizer_path": str(eng.model_path),
                "host": a.host, "port": a.port, "tp_size": self.tp_size,
                # as 0.5.23 resolves and reports them (ServerArgs.resolved_dict): replicas,
                # attention-DP groups, and the deprecated flag true whenever attention DP runs
                "dp_size": self.dp_size, "attn_dp_size": self.attn_dp_size,
                "enable_dp_attention": self.attn_dp_size > 1, "ep_size": 1,
                "pp_size": 1, "random_seed": a.random_seed,
                "skip_tokenizer_init": eng.tokenizer is None, "device": eng.device.type,
                "dtype": a.dtype, "load_format": "auto", "context_length": eng.context_length,
                "max_running_requests": eng.max_running_requests,
                "max_prefill_tokens": eng.max_prefill_tokens,
                "enable_memory_saver": False, "weight_version": str(a.weight_version),
                "disable_radix_cache": eng.prefix_cache is None,
                "radix_cache_max_tokens": (eng.prefix_cache.max_tokens
                                           if eng.prefix_cache is not None else None),
                "enable_metrics": self.enable_metrics,
                "max_total_num_tokens": eng.context_length * eng.max_running_requests,
                "max_req_input_len": eng.context_length - 1,
                "internal_states": [{"num_running_reqs": running, "num_waiting_reqs": waiting,
                                     "num_finished_reqs": eng.num_finished,
                                     "last_gen_throughput": 0.0}],
                "version": PROTOCOL_VERSION, "implementation": IMPLEMENTATION,
                "megatron_gspo_extensions": list(self.extensions),
                "startup_time": self.startup_time, "frontend": "python",
                "launch_command": " ".join(sys.argv), "kv_events": None,
                "weight_sync_impl": self.impl.origin,
                "allow_pickled_tensors": self.args_allow_pickle,
            }

        app.get("/server_info")(server_info)
        app.get("/get_server_info")(server_info)

        def load_snapshot():
            running, waiting = eng.counts()
            total = eng.context_length * eng.max_running_requests
            used = eng.num_used_tokens()
            return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                    "num_used_tokens": used, "max_total_num_tokens": total,
                    "token_usage": used / total if total else 0.0}

        @app.get("/v1/loads")
        async def loads():
            return {"timestamp": time.time(), "version": PROTOCOL_VERSION, "accelerator": "cpu",
                    "num_accelerators": 0, "loads": [load_snapshot()]}

        if self.enable_metrics:  # SGLang mounts /metrics only with --enable-metrics
            @app.get("/metrics")
            async def metrics():
                running, waiting = eng.counts()
                return PlainTextResponse(f"sglang:num_running_reqs {running}\n"
                                         f"sglang:num_queue_reqs {waiting}\n")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": str(eng.model_path), "object": "model",
                                                "owned_by": "sglang", "root": str(eng.model_path)}]}

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache(request: Request):
            # SGLang: ``timeout`` query (float >= 0) -> FlushCacheReqInput.timeout_s, handled by
            # SchedulerFlushWrapper; the answer is a bare Response (no media type)
            try:
                timeout = float(request.query_params.get("timeout", 0.0))
                if not timeout >= 0.0:
                    raise ValueError(f"timeout: {timeout} must be >= 0")
            except ValueError as err:
                return error_response(proto.ParseError(str(err)))
            if self._flush_pending:
                ok, message = False, FLUSH_BUSY
            elif timeout <= 0.0 or eng.is_fully_idle():
                ok, message = eng.flush_cache(), ""
            else:
                self._flush_pending = True
                try:
                    deadline = time.monotonic() + timeout
                    while not eng.is_fully_idle() and time.monotonic() < deadline:
                        await asyncio.sleep(0.01)
                    if eng.is_fully_idle():
                        ok, message = eng.flush_cache(), ""
                    else:
                        ok, message = False, FLUSH_TIMED_OUT
                finally:
                    self._flush_pending = False
            if ok:
                return Response(content=FLUSH_OK, status_code=200)
            return Response(content=message or FLUSH_FAILED, status_code=400)

        @app.post("/abort_request")
        async def abort_request(request: Request):
            try:
                body = await _body(request)
            except ValueError as err:
                return error_response(err)
            rid = body.get("rid") or None
            if body.get("abort_all"):
                eng.abort(abort_all=True)
            elif rid is not None:
                eng.abort(str(rid))
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request):
            try:
                obj = proto.parse_control(await _body(request), "PauseGenerationReqInput")
            except ValueError as err:
                return error_response(err)
            mode = obj["mode"]
            async with self._pause_lock:  # SGLang's is_pause_cond
                self.paused = True
                self._loop_event().clear()
                if mode == "abort":
                    # TokenizerManager.pause_generation: abort everything until no generate
                    # holds the model-update lock (the scheduler itself is not paused)
                    while True:
                        eng.abort(abort_all=True)
                        if not await self._rw.is_locked():
                            break
                        await asyncio.sleep(0.01)
                else:  # the scheduler pauses (_engine_paused); retract frees the KV
                    eng.hold(True)
                    if mode == "retract":
                        await asyncio.wrap_future(eng.call(eng.retract))
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation(request: Request):
            try:
                obj = proto.parse_control(await _body(request), "ContinueGenerationReqInput")
            except ValueError as err:
                return error_response(err)
            async with self._pause_lock:
                if obj["torch_empty_cache"] and eng.device.type == "cuda":
                    torch.cuda.empty_cache()
                self.paused = False
                eng.hold(False)
                self._loop_event().set()
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        async def release_memory_occupation(request: Request):
            # nothing to release on the CPU (SGLang without memory saver); releasing the KV cache
            # (tags null, [] or with "kv_cache") flushes it there (weight_updater.py
            # release_memory_occupation: flush_cache()), so the prefix cache empties here too
            try:
                tags = (await _body(request)).get("tags")
            except ValueError:
                tags = None
            if not tags or (isinstance(tags, list) and "kv_cache" in tags):
                eng.flush_cache()
            return _json(None)

        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def resume_memory_occupation():
            return _json(None)

        def failed(message: str, **extra):
            return _json({"success": False, "message": message, **extra}, 400)

        def negotiated(request) -> set:
            """The extensions this request asked for (header) that the server offers."""
            raw = request.headers.get(EXTENSIONS_HEADER, "")
            return {e.strip() for e in raw.split(",") if e.strip()} & set(self.extensions)

        def answer(success: bool, message: str, ext: set, *, checksums=None, timings=None,
                   **extra):
            """SGLang's ``{"success", "message", ...}`` (400 when not ``success``), plus the
            negotiated extensions' keys only."""
            body = {"success": success, "message": message, **extra}
            if "checksums" in ext and checksums is not None:
                body["checksums"] = checksums
            if "timings" in ext and timings is not None:
                body["timings"] = timings
            return _json(body, 200 if success else 400)

        def fan_out(message: str) -> str:
            """``FanOutCommunicator.merge_results``: one answer per DP rank, joined."""
            return " | ".join([message] * self.num_dp_ranks)

        def replicas_unsupported(what: str):
            """SGLang's ``assert get_parallel().dp_size == 1, ...`` in the TokenizerManager: an
            uncaught AssertionError, which Starlette answers with its plain 500."""
            log.error("AssertionError: data-parallel replicas are not supported for %s "
                      "(--dp-size %d)", what, self.dp_size)
            return PlainTextResponse("Internal Server Error", status_code=500)

        async def locked(fn):
            """An update as the TokenizerManager runs it: at once while paused (holding the
            pause condition), else under the model-update writer lock, which waits for every
            in-flight generate (each holds the reader lock) and holds new ones back."""
            async with self._pause_lock:
                if self.paused:
                    return await fn()
            async with self._rw.writer():
                return await fn()

        def after_update(version, flush: bool) -> tuple[bool, str]:
            """Engine thread, after a successful load: SGLang's
            ``record_weight_version_after_update`` then ``flush_cache_after_weight_update``."""
            eng.set_weight_version(version)
            if flush and not eng.flush_cache():
                return False, FLUSH_REFUSED_AFTER_UPDATE
            return True, ""

        def finish_message(success: bool, message: str, version) -> str:
            """The TokenizerManager's tail: on success the reported version moves."""
            message = fan_out(message)
            if success and version is not None:
                self.reported_weight_version = str(version)
                message += f" Weight version updated to {version}."
            return message

        def on_workers(cmd: str, kws: list[dict]) -> list[concurrent.futures.Future]:
            """Start ``cmd`` on TP ranks 1.. (one kwargs dict each); futures of their results."""
            return [self.tp_workers.submit(i, cmd, kw) for i, kw in enumerate(kws)]

        async def results(futures) -> list:
            return [await asyncio.wrap_future(f) for f in futures]

        @app.post("/begin_weight_update")
        async def begin_weight_update(request: Request):
            try:
                obj = proto.parse_control(await _body(request, required=True),
                                          "BeginWeightUpdateReqInput")
            except ValueError as err:
                return error_response(err)

            async def begin():
                if self._session is not None:
                    return False, SESSION_ALREADY_OPEN
                self._session = obj["selector"]
                return True, "Success"
            success, message = await locked(begin)
            return answer(success, fan_out(message), set())

        @app.post("/end_weight_update")
        async def end_weight_update(request: Request):
            try:
                proto.parse_control(await _body(request, required=True), "EndWeightUpdateReqInput")
            except ValueError as err:
                return error_response(err)

            async def end():
                if self._session is None:
                    return False, NO_SESSION_OPEN
                self._session = None
                return True, "Success"
            success, message = await locked(end)
            return answer(success, fan_out(message), set())

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            try:
                obj = proto.parse_control(await _body(request, required=True),
                                          "UpdateWeightFromDiskReqInput")
            except ValueError as err:
                return error_response(err)
            ext = negotiated(request)
            path, version = obj["model_path"], obj["weight_version"]
            paused_counts = 0 if self.num_dp_ranks == 1 else [0] * self.num_dp_ranks
            if obj["load_format"] not in (None, "auto", "safetensors"):
                return answer(False, f"load_format {obj['load_format']!r} is not supported by "
                              "the local server (auto / safetensors)", ext,
                              num_paused_requests=paused_counts)
            if obj["abort_all_requests"]:
                eng.abort(abort_all=True)

            async def update():
                # keep_pause, is_async, token_step, manifest, recapture_cuda_graph: accepted and
                # unused, as in 0.5.23 (no code there reads keep_pause or is_async; a disk
                # update never changes the pause state)
                try:  # checked first: a refused directory changes nothing on any TP rank
                    await asyncio.to_thread(self._check_weight_dir, path)
                except Exception as err:  # noqa: BLE001 - every refusal is an answer, never a 500
                    return False, (f"Failed to update weights: {err}. The weights are "
                                   "unchanged."), None, None
                try:
                    t0 = time.perf_counter()
                    others = on_workers("disk", [{"path": path}] * len(self.tp_workers))

                    def load():
                        sums = eng.weights.load_shards(path)
                        return sums, after_update(version, obj["flush_cache"])
                    sums, (ok, refusal) = await asyncio.wrap_future(eng.call(load))
                    sums_others = await results(others)
                    timings = {"load_s": time.perf_counter() - t0}
                except Exception as err:  # noqa: BLE001 - reported in the body
                    return False, f"Failed to update weights: {err}", None, None
                checksums = {f: [d, *(o[f] for o in sums_others)] for f, d in sums.items()}
                if not ok:
                    return False, refusal, checksums, timings
                return True, "Succeeded to update model weights.", checksums, timings

            success, message, checksums, timings = await locked(update)
            if success:  # the TokenizerManager's _update_model_path_info
                self.reported_model_path = path
                self.reported_load_format = obj["load_format"] or "auto"
            return answer(success, finish_message(success, message, version), ext,
                          checksums=checksums, timings=timings,
                          num_paused_requests=paused_counts)

        @app.post("/update_weights_from_tensor")
        async def update_weights_from_tensor(request: Request):
            try:
                obj = proto.parse_control(await _body(request, required=True),
                                          "UpdateWeightsFromTensorReqInput")
            except ValueError as err:
                return error_response(err)
            if self.dp_size != 1:
                return replicas_unsupported("update weights from tensor")
            ext = negotiated(request)
            delta = "delta" in ext and bool((await _body(request)).get("delta"))
            payloads, version = obj["serialized_named_tensors"], obj["weight_version"]
            if obj["abort_all_requests"]:
                eng.abort(abort_all=True)

            async def update():
                if self._session is None:
                    return False, OUTSIDE_SESSION.format("update_weights_from_tensor"), None, None
                if not payloads:
                    return False, ("serialized_named_tensors: expected a list with one base64 "
                                   "string per TP rank"), None, None
                try:
                    raw = base64.b64decode(payloads[0], validate=True)
                except (ValueError, TypeError) as err:
                    return False, f"serialized_named_tensors: not base64 ({err})", None, None
                pickled = wt.looks_like_pickle(raw)
                if pickled and not self.args_allow_pickle:
                    return False, ("serialized_named_tensors: a pickled payload (SGLang's "
                                   "MultiprocessingSerializer) is refused: this server reads "
                                   "base64 safetensors unless started with "
                                   "--allow-pickled-tensors (127.0.0.1 only)"), None, None
                if obj["load_format"] not in (None, "direct"):
                    return False, (f"load_format {obj['load_format']!r}: the local server reads "
                                   "named tensors (load_format null or 'direct')"), None, None
                if pickled and len(payloads) != self.tp_size:
                    return False, (f"serialized_named_tensors: {len(payloads)} entries for a "
                                   f"server with tp_size {self.tp_size} (one per TP rank)"), \
                        None, None
                try:
                    if pickled:  # each TP rank deserialises its own entry, as SGLang's do
                        others = on_workers("tensor", [
                            {"payload": payloads[i + 1], "delta": delta}
                            for i in range(len(self.tp_workers))])
                        t0 = time.perf_counter()
                        named = await asyncio.to_thread(
                            lambda: list(self.impl.deserialize(payloads[0])))
                        self._mapped.keep(named)
                    else:
                        t0 = time.perf_counter()
                        named = list((await asyncio.to_thread(decode_named_tensors,
                                                              payloads[0])).items())
                        others = on_workers("named", [{"named": named, "delta": delta}]
                                            * len(self.tp_workers))
                    t1 = time.perf_counter()
                    checksum, (ok, refusal) = await apply_and_check(named, delta, version,
                                                                    obj["flush_cache"])
                    checksums = [checksum, *(await results(others))]
                    timings = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
                except Exception as err:  # noqa: BLE001 - a malformed payload is an answer
                    return False, f"Failed to update weights: {type(err).__name__}: {err}", \
                        None, None
                if not ok:
                    return False, refusal, checksums, timings
                return True, "Success", checksums, timings

            success, message, checksums, timings = await locked(update)
            return answer(success, finish_message(success, message, version), ext,
                          checksums=checksums, timings=timings)

        async def apply_and_check(named: list, delta: bool, version, flush: bool):
            """Load a received bucket (full tensors and, with ``delta``, bf16 deltas) on the
            engine thread, then record the version and flush (:func:`after_update`); returns
            (rank 0's bucket checksum of what it now holds, (ok, refusal message))."""
            full, deltas = wt.delta_pairs(named) if delta else (dict(named), {})

            def load():
                checksum = eng.weights.apply_update(full, deltas, checksum=True)
                return checksum, after_update(version, flush)
            return await asyncio.wrap_future(eng.call(load))

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request):
            try:
                obj = proto.parse_control(await _body(request, required=True),
                                          "InitWeightsUpdateGroupReqInput")
            except ValueError as err:
                return error_response(err)
            if self.dp_size != 1:
                return replicas_unsupported("update weights from distributed")
            addr, port = obj["master_address"], obj["master_port"]
            rank, world = obj["rank_offset"], obj["world_size"]
            name, backend = obj["group_name"], obj["backend"]
            if not 1 <= rank < world:
                return failed(fan_out(
                    f"Failed to initialize custom process group: rank_offset {rank} with "
                    f"world_size {world}: this server joins at ranks 1 .. world_size - 1; "
                    "rank 0 (the trainer) hosts the group's store"))
            if backend != "gloo":
                return failed(fan_out(f"Failed to initialize custom process group: backend "
                                      f"{backend!r}: the local server runs on the CPU, use "
                                      "'gloo'"))
            if name in self._groups:
                return failed(fan_out(f"Failed to initialize custom process group: {name!r} "
                                      "exists"))
            timeout = self.args.weight_update_timeout
            try:  # rank_offset + tp_rank for every TP rank, all at once (they meet in one group)
                others = on_workers("init_group", [
                    {"address": addr, "port": port, "rank": rank + i + 1, "world": world,
                     "name": name, "backend": backend, "timeout_s": timeout}
                    for i in range(len(self.tp_workers))])
                group = await asyncio.to_thread(join_group, self.impl, addr, port, rank, world,
                                                name, backend, timeout)
                await results(others)
            except Exception as err:  # noqa: BLE001 - reported in the body
                return failed(fan_out(f"Failed to initialize custom process group: {err}"))
            self._groups[name] = group
            return {"success": True,
                    "message": fan_out("Succeeded to initialize custom process group.")}

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request):
            try:
                obj = proto.parse_control(await _body(request, required=True),
                                          "UpdateWeightsFromDistributedReqInput")
                names, dtypes, shapes = obj["names"], obj["dtypes"], obj["shapes"]
                if not (len(names) == len(dtypes) == len(shapes)):
                    raise proto.ParseError("names, dtypes and shapes must have the same length")
                for d in dtypes:
                    wt.parse_dtype(d)
            except ValueError as err:
                return error_response(err)
            if self.dp_size != 1:
                return replicas_unsupported("update weights from distributed")
            ext = negotiated(request)
            delta = "delta" in ext and bool((await _body(request)).get("delta"))
            name, version, load_format = obj["group_name"], obj["weight_version"], obj["load_format"]
            if obj["abort_all_requests"]:
                eng.abort(abort_all=True)

            def receive_all(group):
                # One broadcast at a time, in arrival order (SGLang's writer lock). The lock is
                # held for the receive only: loading bucket k overlaps receiving bucket k+1.
                with self._group_lock:
                    others = on_workers("distributed", [
                        {"name": name, "names": names, "dtypes": dtypes, "shapes": shapes,
                         "load_format": load_format, "delta": delta}] * len(self.tp_workers))
                    return receive(self.impl, group, names, dtypes, shapes, load_format,
                                   self._receive_buffers), others

            async def update():
                if self._session is None:
                    return False, OUTSIDE_SESSION.format("update_weights_from_distributed"), \
                        None, None
                group = self._groups.get(name)
                if group is None:
                    return False, (f"Failed to receive weights: no group {name!r}; call "
                                   "/init_weights_update_group first"), None, None
                buf = None
                try:
                    t0 = time.perf_counter()
                    try:
                        (named, buf), others = await asyncio.to_thread(receive_all, group)
                    except Exception as err:  # noqa: BLE001 - SGLang's message
                        return False, f"Failed to receive weights: {err}", None, None
                    t1 = time.perf_counter()
                    checksum, (ok, refusal) = await apply_and_check(named, delta, version,
                                                                    obj["flush_cache"])
                    checksums = [checksum, *(await results(others))]
                    timings = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
                except Exception as err:  # noqa: BLE001 - reported in the body
                    return False, f"Failed to update parameter online: {err}", None, None
                finally:
                    if buf is not None:  # loaded (or failed): the buffer takes the next bucket
                        self._receive_buffers.release(buf)
                if not ok:
                    return False, refusal, checksums, timings
                return True, "Succeeded to update parameter online.", checksums, timings

            success, message, checksums, timings = await locked(update)
            return answer(success, finish_message(success, message, version), ext,
                          checksums=checksums, timings=timings)

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(request: Request):
            try:
                obj = proto.parse_control(await _body(request), "DestroyWeightsUpdateGroupReqInput")
            except ValueError as err:
                return error_response(err)
            if self.dp_size != 1:
                return replicas_unsupported("destroy parameter update group")
            name = obj["group_name"]
            group = self._groups.pop(name, None)
            if group is None:
                return failed(fan_out(f"no group {name!r}"))
            await results(on_workers("destroy_group", [{"name": name}] * len(self.tp_workers)))
            wt.destroy_group(group)
            return {"success": True,
                    "message": fan_out("Succeeded to destroy custom process group.")}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            try:
                obj = proto.parse_control(await _body(request, required=True),
                                          "UpdateWeightVersionReqInput")
            except ValueError as err:
                return error_response(err)
            version = obj["new_version"]
            if obj["abort_all_requests"]:  # SGLang's default: True
                eng.abort(abort_all=True)

            def set_version():
                eng.apply_pending_aborts()  # the scheduler takes the AbortReq first
                eng.set_weight_version(version)
            try:
                await asyncio.wrap_future(eng.call(set_version))
            except Exception as err:  # noqa: BLE001 - SGLang's failure body
                return failed(f"Failed to update weight version: {err}")
            self.reported_weight_version = version
            return {"success": True, "message": f"Weight version updated to {version}",
                    "new_version": version}

        @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
        async def get_weights_by_name(request: Request):
            try:
                body = await _body(request, required=True)
                name, limit = body["name"], int(body.get("truncate_size", 100))
                tensor = await asyncio.wrap_future(eng.call(lambda: eng.weights.get(name)))
            except Exception:  # noqa: BLE001 - SGLang's message
                return _json(proto.value_error_body("Get parameter by name failed"), 400)
            return _json(tensor.float().tolist()[:limit])

        @app.api_route("/weights_checker", methods=["GET", "POST"])
        async def weights_checker(request: Request):
            try:
                body = await _body(request)
            except ValueError as err:
                return error_response(err)
            action = body.get("action", "checksum")
            if action != "checksum":
                return failed(f"action {action!r}: the local server implements 'checksum'")
            others = on_workers("checksum", [{}] * len(self.tp_workers))
            digest = await asyncio.wrap_future(eng.call(eng.weights.checksum))
            return {"success": True, "message": digest, "checksum": digest,
                    "per_engine_checksum": [digest],
                    "per_tp_rank_checksum": [digest, *(await results(others))]}

        return app

    async def _stream(self, request, call, expanded, queue, release=None):
        """SSE, cumulative chunks (SGLang's default), ``data: [DONE]`` at the end."""
        remaining = len(expanded)
        try:
            while remaining:
                try:
                    index, kind = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        for r, _, _ in expanded:
                            self.engine.abort(r.rid)
                        return
                    continue
                r, item, plen = expanded[index]
                if kind == "finish":
                    remaining -= 1
                    chunk = self._response(r, plen, call, item)
                else:
                    if r.finished:
                        continue  # the finish event carries the final chunk
                    chunk = self._partial(r, plen, call, item)
                if call.is_batch:
                    chunk["index"] = index
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for r, _, _ in expanded:
                if not r.finished:
                    self.engine.abort(r.rid)
            if release is not None:
                await release()

    def _partial(self, r: EngineRequest, plen: int, call, item) -> dict:
        n = len(r.output_ids)  # snapshot: the engine thread may append meanwhile
        chunk: dict[str, Any] = {}
        if self.engine.tokenizer is not None:
            chunk["text"] = self.engine.decode(r.output_ids[:n]) or ""
        chunk["output_ids"] = list(r.output_ids[:n])
        meta: dict[str, Any] = {"id": r.rid, "finish_reason": None, "prompt_tokens": plen,
                                "weight_version": self.reported_weight_version,
                                "completion_tokens": n, "cached_tokens": r.cached_tokens,
                                "cached_tokens_details": cached_tokens_details(r.cached_tokens)}
        if item.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(r.output_logprobs[:n], r.output_ids[:n])]
        chunk["meta_info"] = meta
        return chunk


def serve(args) -> int:
    """Load the model, then serve until SIGINT / SIGTERM (uvicorn's handlers)."""
    import uvicorn

    torch.set_num_threads(max(1, args.cpu_threads))
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    t0 = time.time()
    server = LocalRolloutServer(args)
    server.engine.start()
    log.info("loaded %s in %.1f s; serving on http://%s:%d", args.model_path, time.time() - t0,
             args.host, args.port)
    config = uvicorn.Config(server.app, host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=False,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        server.shutdown()
    return 0
