"""The local rollout server's HTTP side: SGLang's native API over :class:`LocalEngine`.

Started by ``megatron-gspo serve`` (``launch/serve.py``). Follows the "minimum behaviour" list of
``docs/sglang_protocol.md``: single / batch / ``n`` / streamed ``/generate`` with
SGLang's ids, ordering, finish reasons, logprob triples and three error shapes; health, info and
load endpoints; flush (400 while busy); abort by rid prefix; pause / continue (new generates block
while paused); release / resume memory (no-ops returning ``null``); the weight endpoints with
``{"success", "message"}`` bodies (400 when ``success`` is false).

Deviations (all documented in docs/rollout.md):

* ``update_weights_from_tensor`` takes SGLang's pickled payloads (shared-memory handles) only with
  ``--allow-pickled-tensors`` on 127.0.0.1, else base64 safetensors (:mod:`pipeline.weight_transport`);
* ``init_weights_update_group`` / ``update_weights_from_distributed`` run over gloo (CPU), with
  SGLang's own group code when the ``sglang`` package is importable; ``--tp-size N`` joins N group
  ranks (:mod:`pipeline.local.tp_ranks`);
* extensions: per-bucket ``checksums`` (per TP rank) in every weight-update answer, ``"delta":
  true`` bf16 deltas, ``weight_sync_impl`` in ``/server_info``, the server's own ``timings``
  (``receive_s``, ``load_s``: load into the model + checksum) in every weight-update answer;
* weight updates land in place: ``update_weights_from_distributed`` receives into two reused
  buffers laid out by SGLang's ``FlattenedTensorBucket`` (no fresh allocation per bucket), the
  trainer's shared-memory buckets stay mapped (``tp_ranks.MappedStorages``), disk shards are
  ``readinto`` the parameters; each weight is checksummed right after it is written;
* ``/weights_checker {"action": "checksum"}`` returns :func:`weights_checksum` (sha256 over the HF
  names, dtypes, shapes and bytes), not SGLang's per-engine digest;
* weight updates are applied between two decoding steps; running requests continue on the new
  weights unless the caller paused (``pause_generation``) or set ``abort_all_requests``.

Limits (a request must not be able to take the server down: ``n: 1000000`` once OOM-killed it):

* ``--max-n``: ``sampling_params.n`` above it is a 400 ``{"error": {"message": ...}}`` (SGLang's
  ValueError shape; SGLang itself has no such limit);
* ``--max-queued-requests`` (SGLang's flag): a request whose samples do not fit in the waiting
  queue is a 503 ``{"detail": "The request queue is full."}``, SGLang's answer when its
  ``--max-queued-requests`` is reached (before anything is queued; a streamed request gets the
  same 503 instead of SGLang's aborted stream);
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
import ipaddress
import json
import logging
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from pipeline import routed_experts
from pipeline import weight_transport as wt
from pipeline.local import protocol as proto
from pipeline.local.engine import (QUEUE_FULL, EngineRequest, LocalEngine, QueueFull,
                                   WeightFileError, shard_headers)
from pipeline.local.tp_ranks import (MappedStorages, ReceiveBuffers, TPWorkers, join_group, receive,
                                     sglang_impl)
from pipeline.weight_transport import decode_named_tensors

log = logging.getLogger("megatron_gspo.serve")

PROTOCOL_VERSION = "0.5.23"  # the SGLang release whose HTTP contract this server follows
DEFAULT_MAX_N = 1024  # --max-n
DEFAULT_MAX_QUEUED = 4096  # --max-queued-requests (SGLang's default: unbounded)
HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _json(content: Any, status: int = 200):
    return JSONResponse(content=content, status_code=status)


async def _body(request, *, required: bool = False) -> dict:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise proto.ParseError("a JSON body is required")
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as err:
        raise proto.ParseError(f"JSON decode error: {err}") from None
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise proto.ParseError("the request body must be a JSON object")
    return body


class LocalRolloutServer:
    """FastAPI app + engine. ``args``: the parsed ``megatron-gspo serve`` namespace."""

    def __init__(self, args):
        self.args = args
        self.tp_size = int(getattr(args, "tp_size", 1) or 1)
        if self.tp_size < 1:
            raise ValueError(f"--tp-size: must be >= 1, got {self.tp_size}")
        self.args_allow_pickle = bool(getattr(args, "allow_pickled_tensors", False))
        if self.args_allow_pickle and not _is_loopback(args.host):
            raise ValueError(f"--allow-pickled-tensors: only with --host 127.0.0.1 (got "
                             f"{args.host}): deserialising a pickle runs code, so such payloads "
                             "must never come from the network")
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
            device=getattr(args, "device", "cpu"))
        self.weight_roots = [self.engine.model_path] + [
            Path(r).resolve() for r in (getattr(args, "weight_roots", None) or [])]
        """Directories update_weights_from_disk may read (resolved): the model's and
        --weight-roots."""
        self.startup_time = time.time()
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
        meta["weight_version"] = r.weight_version
        if not queued_abort:
            meta["num_retractions"] = 0
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
            meta["cached_tokens"] = 0
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
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            def notify(index, req):
                def on_event(kind: str) -> None:
                    if kind == "finish" or call.stream:
                        loop.call_soon_threadsafe(queue.put_nowait, (index, kind))
                return on_event

            try:
                expanded = self._expand(call, notify)
                eng.submit([r for r, _, _ in expanded])
            except ValueError as err:
                return error_response(err)
            except QueueFull:
                return _json({"detail": QUEUE_FULL}, 503)
            except RuntimeError as err:
                return _json(proto.value_error_body(str(err)), 503)
            if call.stream:
                return StreamingResponse(self._stream(request, call, expanded, queue),
                                         media_type="text/event-stream")
            remaining = len(expanded)
            while remaining:
                try:
                    await asyncio.wait_for(queue.get(), timeout=1.0)
                    remaining -= 1
                except asyncio.TimeoutError:
                    if await request.is_disconnected():  # the client gave up: free the batch
                        for r, _, _ in expanded:
                            eng.abort(r.rid)
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
            return {
                "model_path": str(eng.model_path), "served_model_name": str(eng.model_path),
                "tokenizer_path": str(eng.model_path), "is_generation": True,
                "preferred_sampling_params": None, "weight_version": eng.weight_version,
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": None,
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
                "host": a.host, "port": a.port, "tp_size": self.tp_size, "dp_size": 1, "ep_size": 1,
                "pp_size": 1, "attn_dp_size": 1, "random_seed": a.random_seed,
                "skip_tokenizer_init": eng.tokenizer is None, "device": eng.device.type,
                "dtype": a.dtype, "load_format": "auto", "context_length": eng.context_length,
                "max_running_requests": eng.max_running_requests,
                "max_prefill_tokens": eng.max_prefill_tokens,
                "enable_memory_saver": False, "weight_version": eng.weight_version,
                "max_total_num_tokens": eng.context_length * eng.max_running_requests,
                "max_req_input_len": eng.context_length - 1,
                "internal_states": [{"num_running_reqs": running, "num_waiting_reqs": waiting,
                                     "num_finished_reqs": eng.num_finished,
                                     "last_gen_throughput": 0.0}],
                "version": PROTOCOL_VERSION, "implementation": "megatron-gspo local rollout server",
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

        @app.get("/get_load")
        async def get_load():
            s = load_snapshot()
            return [{"dp_rank": 0, "num_reqs": s["num_running_reqs"] + s["num_waiting_reqs"],
                     "num_waiting_reqs": s["num_waiting_reqs"], "num_tokens": s["num_used_tokens"]}]

        @app.get("/v1/loads")
        async def loads():
            return {"timestamp": time.time(), "version": PROTOCOL_VERSION, "accelerator": "cpu",
                    "num_accelerators": 0, "loads": [load_snapshot()]}

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
        async def flush_cache():
            running, waiting = eng.counts()
            if running or waiting:
                return PlainTextResponse("Cache not flushed. There are running or waiting requests "
                                         f"({running} running, {waiting} waiting).\n", 400)
            return PlainTextResponse(FLUSH_OK)

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
                body = await _body(request)
            except ValueError as err:
                return error_response(err)
            mode = body.get("mode") or "abort"
            if mode not in ("abort", "retract", "in_place"):
                return _json(proto.value_error_body(
                    f"mode: {mode!r}, expected 'abort', 'retract' or 'in_place'"), 400)
            self.paused = True
            self._loop_event().clear()
            if mode == "abort":
                eng.abort(abort_all=True)
                deadline = time.monotonic() + 60.0
                while eng.counts() != (0, 0) and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)
            else:
                eng.hold(True)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation():
            eng.hold(False)
            self.paused = False
            self._loop_event().set()
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def memory_occupation():
            return _json(None)  # nothing to release on the CPU (SGLang without memory saver)

        def failed(message: str, **extra):
            return _json({"success": False, "message": message, **extra}, 400)

        async def apply(tensors: dict, version: Optional[str]):
            def load():
                eng.load_weights(tensors)
                if version is not None:
                    eng.weight_version = str(version)
            await asyncio.wrap_future(eng.call(load))

        async def apply_and_check(named: list, delta: bool, version: Optional[str]) -> str:
            """Load a received bucket (full tensors and, with ``delta``, bf16 deltas) on the
            engine thread; returns rank 0's bucket checksum of what it now holds."""
            full, deltas = wt.delta_pairs(named) if delta else (dict(named), {})

            def load():
                checksum = eng.apply_update(full, deltas, checksum=True)
                if version is not None:
                    eng.weight_version = str(version)
                return checksum
            return await asyncio.wrap_future(eng.call(load))

        def on_workers(cmd: str, kws: list[dict]) -> list[concurrent.futures.Future]:
            """Start ``cmd`` on TP ranks 1.. (one kwargs dict each); futures of their results."""
            return [self.tp_workers.submit(i, cmd, kw) for i, kw in enumerate(kws)]

        async def results(futures) -> list:
            return [await asyncio.wrap_future(f) for f in futures]

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            try:
                body = await _body(request, required=True)
            except ValueError as err:
                return error_response(err)
            path, version = body.get("model_path"), body.get("weight_version")
            if not isinstance(path, str) or not path:
                return failed("model_path: required (a directory of safetensors files)",
                              num_paused_requests=0)
            if body.get("load_format") not in (None, "auto", "safetensors"):
                return failed(f"load_format {body['load_format']!r} is not supported by the "
                              "local server (auto / safetensors)", num_paused_requests=0)
            if body.get("abort_all_requests"):
                eng.abort(abort_all=True)

            def load():
                sums = eng.load_shards(path)
                if version is not None:
                    eng.weight_version = str(version)
                return sums
            try:  # checked first: a refused directory changes nothing on any TP rank
                await asyncio.to_thread(self._check_weight_dir, path)
            except Exception as err:  # noqa: BLE001 - every refusal is an answer, never a 500
                return failed(f"Failed to update weights: {err}. The weights are unchanged.",
                              num_paused_requests=0)
            try:
                t0 = time.perf_counter()
                others = on_workers("disk", [{"path": path}] * len(self.tp_workers))
                sums = await asyncio.wrap_future(eng.call(load))
                sums_others = await results(others)
                timings = {"load_s": time.perf_counter() - t0}
            except Exception as err:  # noqa: BLE001 - reported in the body
                return failed(f"Failed to update weights: {err}", num_paused_requests=0)
            msg = "Succeeded to update model weights."
            if version is not None:
                msg += f" Weight version updated to {version}."
            checksums = {f: [d, *(o[f] for o in sums_others)] for f, d in sums.items()}
            return {"success": True, "message": msg, "num_paused_requests": 0,
                    "checksums": checksums, "timings": timings}

        @app.post("/update_weights_from_tensor")
        async def update_weights_from_tensor(request: Request):
            try:
                body = await _body(request, required=True)
            except ValueError as err:
                return error_response(err)
            payloads = body.get("serialized_named_tensors")
            if isinstance(payloads, str):
                payloads = [payloads]
            if not isinstance(payloads, list) or not payloads or not isinstance(payloads[0], str):
                return failed("serialized_named_tensors: expected a list with one base64 "
                              "string per TP rank")
            delta = bool(body.get("delta"))
            try:
                raw = base64.b64decode(payloads[0], validate=True)
            except (ValueError, TypeError) as err:
                return failed(f"serialized_named_tensors: not base64 ({err})")
            pickled = wt.looks_like_pickle(raw)
            if pickled and not self.args_allow_pickle:
                return failed("serialized_named_tensors: a pickled payload (SGLang's "
                              "MultiprocessingSerializer) is refused: this server reads base64 "
                              "safetensors unless started with --allow-pickled-tensors "
                              "(127.0.0.1 only)")
            if body.get("load_format") not in (None, "direct"):
                return failed(f"load_format {body['load_format']!r}: the local server reads "
                              "named tensors (load_format null or 'direct')")
            if pickled and len(payloads) != self.tp_size:
                return failed(f"serialized_named_tensors: {len(payloads)} entries for a server "
                              f"with tp_size {self.tp_size} (one per TP rank)")
            if body.get("abort_all_requests"):
                eng.abort(abort_all=True)
            try:
                if pickled:  # each TP rank deserialises its own entry, as SGLang's do
                    others = on_workers("tensor", [{"payload": payloads[i + 1], "delta": delta}
                                                   for i in range(len(self.tp_workers))])
                    t0 = time.perf_counter()
                    named = await asyncio.to_thread(lambda: list(self.impl.deserialize(payloads[0])))
                    self._mapped.keep(named)
                else:
                    t0 = time.perf_counter()
                    named = list((await asyncio.to_thread(decode_named_tensors, payloads[0])).items())
                    others = on_workers("named", [{"named": named, "delta": delta}]
                                        * len(self.tp_workers))
                t1 = time.perf_counter()
                checksum = await apply_and_check(named, delta, body.get("weight_version"))
                checksums = [checksum, *(await results(others))]
                timings = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
            except Exception as err:  # noqa: BLE001 - a malformed payload is an answer, not a 500
                return failed(f"Failed to update weights: {type(err).__name__}: {err}")
            return {"success": True, "message": "Success", "checksums": checksums,
                    "timings": timings}

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request):
            try:
                body = await _body(request, required=True)
                addr, port = body["master_address"], int(body["master_port"])
                rank, world = int(body.get("rank_offset", 1)), int(body["world_size"])
            except (KeyError, TypeError, ValueError) as err:
                return failed(f"Failed to initialize custom process group: bad request ({err})")
            if not 1 <= rank < world:
                return failed(f"Failed to initialize custom process group: rank_offset {rank} "
                              f"with world_size {world}: this server joins at ranks 1 .. "
                              "world_size - 1; rank 0 (the trainer) hosts the group's store")
            name = body.get("group_name") or "weight_update_group"
            backend = body.get("backend") or "gloo"
            if backend != "gloo":
                return failed(f"backend {backend!r}: the local server runs on the CPU, use 'gloo'")
            if name in self._groups:
                return failed(f"Failed to initialize custom process group: {name!r} exists")
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
                return failed(f"Failed to initialize custom process group: {err}")
            self._groups[name] = group
            return {"success": True, "message": "Succeeded to initialize custom process group."}

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request):
            try:
                body = await _body(request, required=True)
                names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
                if not (len(names) == len(dtypes) == len(shapes)):
                    raise ValueError("names, dtypes and shapes must have the same length")
                for d in dtypes:
                    wt.parse_dtype(d)
            except (KeyError, TypeError, ValueError) as err:
                return failed(f"Failed to update parameter online: bad request ({err})")
            name = body.get("group_name") or "weight_update_group"
            if name not in self._groups:
                return failed(f"Failed to update parameter online: no group {name!r}; call "
                              "/init_weights_update_group first")
            group = self._groups[name]
            load_format = body.get("load_format")
            delta = bool(body.get("delta"))
            if body.get("abort_all_requests"):
                eng.abort(abort_all=True)

            def receive_all():
                # One broadcast at a time, in arrival order (SGLang's writer lock). The lock is
                # held for the receive only: loading bucket k overlaps receiving bucket k+1.
                with self._group_lock:
                    others = on_workers("distributed", [
                        {"name": name, "names": names, "dtypes": dtypes, "shapes": shapes,
                         "load_format": load_format, "delta": delta}] * len(self.tp_workers))
                    return receive(self.impl, group, names, dtypes, shapes, load_format,
                                   self._receive_buffers), others

            buf = None
            try:
                t0 = time.perf_counter()
                (named, buf), others = await asyncio.to_thread(receive_all)
                t1 = time.perf_counter()
                checksum = await apply_and_check(named, delta, body.get("weight_version"))
                checksums_others = await results(others)
                timings = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
            except Exception as err:  # noqa: BLE001 - reported in the body
                return failed(f"Failed to update parameter online: {err}")
            finally:
                if buf is not None:  # loaded (or failed): the buffer takes the next bucket
                    self._receive_buffers.release(buf)
            return {"success": True, "message": "Succeeded to update parameter online.",
                    "checksums": [checksum, *checksums_others], "timings": timings}

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(request: Request):
            try:
                body = await _body(request)
            except ValueError as err:
                return error_response(err)
            name = body.get("group_name") or "weight_update_group"
            group = self._groups.pop(name, None)
            if group is None:
                return failed(f"no group {name!r}")
            await results(on_workers("destroy_group", [{"name": name}] * len(self.tp_workers)))
            wt.destroy_group(group)
            return {"success": True, "message": "Succeeded to destroy custom process group."}

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            try:
                body = await _body(request, required=True)
            except ValueError as err:
                return error_response(err)
            version = body.get("new_version")
            if version is None:
                return failed("new_version: required")
            if body.get("abort_all_requests", True):
                eng.abort(abort_all=True)

            def set_version():
                eng.weight_version = str(version)
            await asyncio.wrap_future(eng.call(set_version))
            return {"success": True, "message": f"Weight version updated to {version}",
                    "new_version": str(version)}

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
            digest = await asyncio.wrap_future(eng.call(eng.checksum))
            return {"success": True, "message": digest, "checksum": digest,
                    "per_engine_checksum": [digest],
                    "per_tp_rank_checksum": [digest, *(await results(others))]}

        return app

    async def _stream(self, request, call, expanded, queue):
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

    def _partial(self, r: EngineRequest, plen: int, call, item) -> dict:
        n = len(r.output_ids)  # snapshot: the engine thread may append meanwhile
        chunk: dict[str, Any] = {}
        if self.engine.tokenizer is not None:
            chunk["text"] = self.engine.decode(r.output_ids[:n]) or ""
        chunk["output_ids"] = list(r.output_ids[:n])
        meta: dict[str, Any] = {"id": r.rid, "finish_reason": None, "prompt_tokens": plen,
                                "weight_version": self.engine.weight_version,
                                "completion_tokens": n, "cached_tokens": 0}
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
