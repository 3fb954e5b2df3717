"""What the local rollout server's routes share: :class:`ServerState`, its locks, and the steps
every control and weight-update route is made of.

One :class:`ServerState` per server (``app.state.server``; the routes of :mod:`pipeline.local.routes`
read it from their request). It holds the engine, the limits and the layout parsed from the flags,
the state SGLang's TokenizerManager keeps (the reported weight version, the pause state, the
model-update lock, the weight-update session, the update groups) and the TP rank processes; its
methods are the shared steps of the routes: :meth:`ServerState.negotiated` (the extensions a request
asked for), :meth:`ServerState.locked` (an update under SGLang's locking),
:meth:`ServerState.after_update` (record the version, flush), :meth:`ServerState.update_answer`
(the TokenizerManager's answer), :meth:`ServerState.fan_out` (one answer per DP rank).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from fastapi.responses import JSONResponse, PlainTextResponse

from pipeline.local import health_env
from pipeline.local import protocol as proto
from pipeline.local.args import (DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_N, DEFAULT_MAX_QUEUED,
                                 DEFAULT_MAX_REQUEST_MB, DEFAULT_MAX_WEIGHT_UPDATE_MB, arg_or,
                                 is_loopback, resolve_dp_layout)
from pipeline.local.bodies import json_response
from pipeline.local.engine import LocalEngine
from pipeline.local.tp_ranks import MappedStorages, ReceiveBuffers, TPWorkers, sglang_impl
from pipeline.local.weight_table import WeightFileError, shard_headers
from pipeline.weights import transport as wt

log = logging.getLogger("megatron_gspo.serve")


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


@dataclass(frozen=True, slots=True)
class UpdateOutcome:
    """What a weight update did (run under :meth:`ServerState.locked`), before the
    TokenizerManager's tail (:meth:`ServerState.update_answer`) turns it into the answer."""

    success: bool
    message: str
    """SGLang's message for one DP rank (the answer joins one per rank)."""
    checksums: Any = None
    """Extension ``checksums``: per TP rank (a list), or per shard file and TP rank (a dict)."""
    timings: Optional[dict] = None
    """Extension ``timings``: ``receive_s`` / ``load_s``."""


class ServerState:
    """The server's engine, limits, layout and TokenizerManager state (see the module docstring).
    ``args``: the parsed flags (:func:`pipeline.local.args.add_arguments`); every limit and the
    layout are checked before the model is loaded."""

    def __init__(self, args):
        self.args = args
        self.tp_size = int(arg_or(args, "tp_size", 1))
        if self.tp_size < 1:
            raise ValueError(f"--tp-size: must be >= 1, got {self.tp_size}")
        self.args_allow_pickle = bool(getattr(args, "allow_pickled_tensors", False))
        if self.args_allow_pickle and not is_loopback(args.host):
            raise ValueError(f"--allow-pickled-tensors: only with --host 127.0.0.1 (got "
                             f"{args.host}): deserialising a pickle runs code, so such payloads "
                             "must never come from the network")
        self.max_request_bytes = int(arg_or(args, "max_request_mb", DEFAULT_MAX_REQUEST_MB)
                                     * (1 << 20))
        self.max_weight_update_bytes = int(
            arg_or(args, "max_weight_update_mb", DEFAULT_MAX_WEIGHT_UPDATE_MB) * (1 << 20))
        self.max_json_depth = int(arg_or(args, "max_json_depth", DEFAULT_MAX_JSON_DEPTH))
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
            radix_cache_max_tokens=getattr(args, "radix_cache_max_tokens", None),
            quantization=getattr(args, "quantization", None))
        self.weight_roots = [self.engine.model_path] + [
            Path(r).resolve() for r in (getattr(args, "weight_roots", None) or [])]
        """Directories update_weights_from_disk may read (resolved): the model's and
        --weight-roots."""
        self.startup_time = time.time()
        self.extensions = [] if getattr(args, "no_extensions", False) else list(proto.EXTENSIONS)
        """The extensions offered (``--no-extensions``: none, every request is plain SGLang)."""
        self.dp_size, self.attn_dp_size = resolve_dp_layout(
            int(arg_or(args, "dp_size", 1)), int(arg_or(args, "attn_dp_size", 1)),
            bool(getattr(args, "enable_dp_attention", False)), self.tp_size)
        self.num_dp_ranks = self.dp_size * self.attn_dp_size  # SGLang's num_dp_ranks_of
        self.enable_metrics = bool(getattr(args, "enable_metrics", False))
        self.reported_weight_version = str(args.weight_version)
        """The TokenizerManager's weight version (``/model_info``, ``meta_info.weight_version``
        of unfinished chunks); the engine's (the scheduler's) moves first, this one only when
        the update answered success."""
        self.reported_model_path = str(self.engine.model_path)  # moved by a disk update
        self.reported_load_format = "auto"
        self.session: Optional[str] = None  # the open weight-update session's selector
        self.rw = RWLock()  # model_update_lock: generates read, unpaused updates write
        self.pause_lock = asyncio.Lock()  # SGLang's is_pause_cond
        self.flush_pending = False
        self.paused = False
        self.shutting_down = False
        self.health_check_timeout_s = health_env.timeout_from_env()
        """SGLANG_HEALTH_CHECK_TIMEOUT: how long a generating health check waits (default 20)."""
        self.health_generation = health_env.generation_from_env()
        """SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: whether ``/health`` generates a token."""
        self.healthy = True
        """False after a failed health check until one succeeds (SGLang's ServerStatus)."""
        self._not_paused: Optional[asyncio.Event] = None
        self.groups: dict[str, Any] = {}  # group_name -> rank 0's update group
        self.group_lock = threading.Lock()
        self.impl = sglang_impl()  # SGLang's own weight-update code where it is installed
        self.receive_buffers = ReceiveBuffers(2)  # bucket k loads while bucket k+1 arrives
        self.mapped = MappedStorages()  # the trainer's shared-memory buckets stay mapped
        self.tp_workers = TPWorkers(self.tp_size, args.model_path, args.dtype,
                                    getattr(args, "quantization", None))

    def shutdown(self) -> None:
        """Stop the engine thread and the TP rank processes."""
        self.shutting_down = True
        self.engine.stop()
        self.tp_workers.stop()

    def not_paused(self) -> asyncio.Event:
        """Set while generation is not paused (``pause_generation`` clears it: new generates
        wait); made in the server's event loop at first use."""
        if self._not_paused is None:
            self._not_paused = asyncio.Event()
            if not self.paused:
                self._not_paused.set()
        return self._not_paused

    # ------------------------------------------------------------------ weight directories
    def _confined(self, path: Path) -> bool:
        real = path.resolve()
        return any(real == root or root in real.parents for root in self.weight_roots)

    def check_weight_dir(self, model_path: str) -> dict:
        """The validated shard headers of ``model_path`` (``weight_table.shard_headers``), every
        file inside the allowed roots; :class:`WeightFileError` / ``OSError`` saying why not."""
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

    # ------------------------------------------------------------------ answers
    @staticmethod
    def failed(message: str, **extra) -> JSONResponse:
        return json_response({"success": False, "message": message, **extra}, 400)

    def negotiated(self, request) -> set:
        """The extensions this request asked for (header) that the server offers."""
        raw = request.headers.get(proto.EXTENSIONS_HEADER, "")
        return {e.strip() for e in raw.split(",") if e.strip()} & set(self.extensions)

    @staticmethod
    def answer(success: bool, message: str, ext: set, *, checksums=None, timings=None,
               **extra) -> JSONResponse:
        """SGLang's ``{"success", "message", ...}`` (400 when not ``success``), plus the
        negotiated extensions' keys only."""
        body = {"success": success, "message": message, **extra}
        if "checksums" in ext and checksums is not None:
            body["checksums"] = checksums
        if "timings" in ext and timings is not None:
            body["timings"] = timings
        return json_response(body, 200 if success else 400)

    def fan_out(self, message: str) -> str:
        """``FanOutCommunicator.merge_results``: one answer per DP rank, joined."""
        return " | ".join([message] * self.num_dp_ranks)

    def replicas_unsupported(self, what: str) -> PlainTextResponse:
        """SGLang's ``assert get_parallel().dp_size == 1, ...`` in the TokenizerManager: an
        uncaught AssertionError, which Starlette answers with its plain 500."""
        log.error("AssertionError: data-parallel replicas are not supported for %s "
                  "(--dp-size %d)", what, self.dp_size)
        return PlainTextResponse("Internal Server Error", status_code=500)

    def update_answer(self, outcome: UpdateOutcome, version, ext: set, **extra) -> JSONResponse:
        """The TokenizerManager's tail of an update: the message of every DP rank; on success
        the reported version moves (and the message says so)."""
        message = self.fan_out(outcome.message)
        if outcome.success and version is not None:
            self.reported_weight_version = str(version)
            message += f" Weight version updated to {version}."
        return self.answer(outcome.success, message, ext, checksums=outcome.checksums,
                           timings=outcome.timings, **extra)

    # ------------------------------------------------------------------ running an update
    async def locked(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """An update as the TokenizerManager runs it: at once while paused (holding the
        pause condition), else under the model-update writer lock, which waits for every
        in-flight generate (each holds the reader lock) and holds new ones back."""
        async with self.pause_lock:
            if self.paused:
                return await fn()
        async with self.rw.writer():
            return await fn()

    def after_update(self, version, flush: bool) -> tuple[bool, str]:
        """Engine thread, after a successful load: SGLang's
        ``record_weight_version_after_update`` then ``flush_cache_after_weight_update``."""
        self.engine.set_weight_version(version)
        if flush and not self.engine.flush_cache():
            return False, proto.FLUSH_REFUSED_AFTER_UPDATE
        return True, ""

    async def apply_and_check(self, named: list, delta: bool, version, flush: bool):
        """Load a received bucket (full tensors and, with ``delta``, bf16 deltas) on the
        engine thread, then record the version and flush (:meth:`after_update`); returns
        (rank 0's bucket checksum of what it now holds, (ok, refusal message))."""
        eng = self.engine
        full, deltas = wt.delta_pairs(named) if delta else (dict(named), {})

        def load():
            checksum = eng.weights.apply_update(full, deltas, checksum=True)
            return checksum, self.after_update(version, flush)
        return await asyncio.wrap_future(eng.call(load))

    def on_workers(self, cmd: str, kws: list[dict]) -> list[concurrent.futures.Future]:
        """Start ``cmd`` on TP ranks 1.. (one kwargs dict each); futures of their results."""
        return [self.tp_workers.submit(i, cmd, kw) for i, kw in enumerate(kws)]

    @staticmethod
    async def results(futures) -> list:
        return [await asyncio.wrap_future(f) for f in futures]
