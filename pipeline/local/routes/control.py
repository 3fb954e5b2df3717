"""Control routes: ``/flush_cache``, ``/abort_request``, ``/pause_generation``,
``/continue_generation``, ``/release_memory_occupation`` and ``/resume_memory_occupation``, as
SGLang 0.5.23 answers them (the rules: :mod:`pipeline.local.server`'s docstring); :func:`register`
adds them to the app."""

from __future__ import annotations

import asyncio
import time

import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pipeline.local import protocol as proto
from pipeline.local.bodies import error_response, json_response, read_body
from pipeline.local.state import ServerState


def register(app: FastAPI) -> None:
    app.api_route("/flush_cache", methods=["GET", "POST"])(flush_cache)
    app.post("/abort_request")(abort_request)
    app.post("/pause_generation")(pause_generation)
    app.post("/continue_generation")(continue_generation)
    app.api_route("/release_memory_occupation",
                  methods=["GET", "POST"])(release_memory_occupation)
    app.api_route("/resume_memory_occupation",
                  methods=["GET", "POST"])(resume_memory_occupation)


async def flush_cache(request: Request):
    # SGLang: ``timeout`` query (float >= 0) -> FlushCacheReqInput.timeout_s, handled by
    # SchedulerFlushWrapper; the answer is a bare Response (no media type)
    state: ServerState = request.app.state.server
    eng = state.engine
    try:
        timeout = float(request.query_params.get("timeout", 0.0))
        if not timeout >= 0.0:
            raise ValueError(f"timeout: {timeout} must be >= 0")
    except ValueError as err:
        return error_response(proto.ParseError(str(err)))
    if state.flush_pending:
        ok, message = False, proto.FLUSH_BUSY
    elif timeout <= 0.0 or eng.is_fully_idle():
        ok, message = eng.flush_cache(), ""
    else:
        state.flush_pending = True
        try:
            deadline = time.monotonic() + timeout
            while not eng.is_fully_idle() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            if eng.is_fully_idle():
                ok, message = eng.flush_cache(), ""
            else:
                ok, message = False, proto.FLUSH_TIMED_OUT
        finally:
            state.flush_pending = False
    if ok:
        return Response(content=proto.FLUSH_OK, status_code=200)
    return Response(content=message or proto.FLUSH_FAILED, status_code=400)


async def abort_request(request: Request):
    eng = request.app.state.server.engine
    try:
        body = await read_body(request)
    except ValueError as err:
        return error_response(err)
    rid = body.get("rid") or None
    if body.get("abort_all"):
        eng.abort(abort_all=True)
    elif rid is not None:
        eng.abort(str(rid))
    return Response(status_code=200)


async def pause_generation(request: Request):
    state: ServerState = request.app.state.server
    eng = state.engine
    try:
        obj = proto.parse_control(await read_body(request), "PauseGenerationReqInput")
    except ValueError as err:
        return error_response(err)
    mode = obj["mode"]
    async with state.pause_lock:  # SGLang's is_pause_cond
        state.paused = True
        state.not_paused().clear()
        if mode == "abort":
            # TokenizerManager.pause_generation: abort everything until no generate
            # holds the model-update lock (the scheduler itself is not paused)
            while True:
                eng.abort(abort_all=True)
                if not await state.rw.is_locked():
                    break
                await asyncio.sleep(0.01)
        else:  # the scheduler pauses (_engine_paused); retract frees the KV
            eng.hold(True)
            if mode == "retract":
                await asyncio.wrap_future(eng.call(eng.retract))
    return {"message": "Generation paused successfully.", "status": "ok"}


async def continue_generation(request: Request):
    state: ServerState = request.app.state.server
    eng = state.engine
    try:
        obj = proto.parse_control(await read_body(request), "ContinueGenerationReqInput")
    except ValueError as err:
        return error_response(err)
    async with state.pause_lock:
        if obj["torch_empty_cache"] and eng.device.type == "cuda":
            torch.cuda.empty_cache()
        state.paused = False
        eng.hold(False)
        state.not_paused().set()
    return {"message": "Generation continued successfully.", "status": "ok"}


async def release_memory_occupation(request: Request):
    # nothing to release on the CPU (SGLang without memory saver); releasing the KV cache
    # (tags null, [] or with "kv_cache") flushes it there (weight_updater.py
    # release_memory_occupation: flush_cache()), so the prefix cache empties here too
    try:
        tags = (await read_body(request)).get("tags")
    except ValueError:
        tags = None
    if not tags or (isinstance(tags, list) and "kv_cache" in tags):
        request.app.state.server.engine.flush_cache()
    return json_response(None)


async def resume_memory_occupation():
    return json_response(None)
