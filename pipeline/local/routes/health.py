"""Health routes: ``/health``, ``/health_generate`` and ``/ready``, as SGLang 0.5.23 answers them
(``srt/entrypoints/http_server.py`` ``health_generate`` and ``ready``); :func:`register` adds
them to the app.

``/health`` and ``/health_generate`` (one handler, as in SGLang):

* 503 while the server shuts down (SGLang's ``gracefully_exit``; here also once the engine
  thread has failed, where SGLang's watchdog ends the whole server);
* ``/health`` only: 200 at once when ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false
  (SGLang's switch, default true, parsed as its ``EnvBool``: ``true/1/yes/y``,
  ``false/0/no/n``, anything else a warning and the default);
* otherwise a one-token generation (rid ``HEALTH_CHECK_<uuid>``, ``input_ids [0]``, greedy)
  that, like every generate, **waits while generation is paused** (``pause_generation`` until
  ``continue_generation``) and then holds the model-update reader lock; the answer is 200 as
  soon as the engine has produced anything after the check began (a token or the end of any
  request, or the result of a call it ran, such as a weight load: SGLang's
  ``last_receive_tstamp``, bumped by every message from its scheduler), and 503 when
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (SGLang's variable, an integer, default 20) pass
  without anything, which also marks the server unhealthy for ``/ready`` until a check
  succeeds. A paused server with nothing running therefore answers nothing for 20 s, then 503,
  as SGLang does: a router's health check (sglang-router: 5 s timeout) fails throughout a
  weight sync's pause (docs/sglang_protocol.md, "Health while paused").

One deviation, for speed: SGLang looks at ``last_receive_tstamp`` once a second (a check takes
at least 1 s); this server looks every :data:`POLL_S`, so it answers the same, sooner.

``/ready``: 200 unless paused, shutting down or unhealthy after a failed check (SGLang's
``is_ready``: ``not is_pause and is_healthy()``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pipeline.local import protocol as proto
from pipeline.local.health_env import RID_PREFIX
from pipeline.local.request import EngineRequest
from pipeline.local.state import ServerState

log = logging.getLogger("megatron_gspo.serve")

POLL_S = 0.02
"""How often a check looks whether the engine produced something (SGLang: once a second)."""


def register(app: FastAPI) -> None:
    app.get("/health")(app.get("/health_generate")(health))
    app.get("/ready")(ready)


async def health(request: Request):
    state: ServerState = request.app.state.server
    eng = state.engine
    if state.shutting_down or not eng.alive:
        return Response(status_code=503)
    if request.url.path == "/health" and not state.health_generation:
        return Response(status_code=200)
    tic = time.monotonic()
    rid = f"{RID_PREFIX}_{uuid.uuid4().hex}"
    task = asyncio.create_task(_generate_one_token(state, rid))
    try:
        deadline = tic + state.health_check_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
            if eng.last_output_time > tic:
                state.healthy = True
                return Response(status_code=200)
        log.error("Health check failed. Server couldn't get a response from the engine for last "
                  "%d seconds%s.", state.health_check_timeout_s,
                  " (generation is paused)" if state.paused else "")
        state.healthy = False
        return Response(status_code=503)
    finally:
        task.cancel()
        eng.abort(rid)


async def _generate_one_token(state: ServerState, rid: str) -> None:
    """The check's generation, as every generate runs: it waits while paused, then holds the
    model-update reader lock until its answer. A refusal (a full queue) is dropped: the check
    still answers 200 if the engine produces anything else (SGLang's task fails the same way)."""
    await state.not_paused().wait()
    await state.rw.acquire_reader()
    try:
        loop = asyncio.get_running_loop()
        done = asyncio.Event()
        req = EngineRequest(rid, [0], proto.parse_sampling({"max_new_tokens": 1,
                                                             "temperature": 0.0}),
                            on_event=lambda kind: kind == "finish"
                            and loop.call_soon_threadsafe(done.set))
        try:
            state.engine.submit([req])
        except (ValueError, RuntimeError):
            return
        await done.wait()
    finally:
        await state.rw.release_reader()


async def ready(request: Request):
    state: ServerState = request.app.state.server
    up = state.engine.alive and not state.shutting_down and state.healthy and not state.paused
    return Response(status_code=200 if up else 503)
