"""``/generate``: SGLang's native generate route on :class:`~pipeline.local.engine.LocalEngine`.

A request is parsed (:func:`pipeline.local.protocol.parse_generate`), expanded into one
:class:`~pipeline.local.request.EngineRequest` per sample, submitted under the model-update
reader lock (an update to an unpaused server waits for it), and answered with SGLang's body
(:func:`response`), or streamed as SGLang's cumulative SSE chunks (:func:`stream`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pipeline.generation import routed_experts
from pipeline.local import protocol as proto
from pipeline.local.bodies import error_response, json_response, read_body, render_json
from pipeline.local.request import (QUEUE_FULL, EngineRequest, QueueFull,
                                    add_weight_versions_to_meta_info)
from pipeline.local.state import ServerState

def register(app: FastAPI) -> None:
    app.api_route("/generate", methods=["POST", "PUT"])(generate)


def cached_tokens_details(cached_tokens: int) -> Optional[dict]:
    """``meta_info.cached_tokens_details`` as 0.5.23 fills it without a hierarchical cache
    (``SchedulerOutputStreamer.get_cached_tokens_details``, put in meta_info by the
    TokenizerManager whenever the batch carries the list): None without a cache hit, else the
    hit, all of it from the device tier."""
    return {"device": cached_tokens, "host": 0} if cached_tokens > 0 else None


async def generate(request: Request):
    state: ServerState = request.app.state.server
    eng = state.engine
    try:
        body = await read_body(request, required=True)
        call = proto.parse_generate(body)
        n = call.items[0].sampling.n
        if n > state.max_n:
            raise ValueError(f"n: {n} samples per prompt exceed this server's --max-n "
                             f"{state.max_n}; send fewer per request")
    except ValueError as err:
        return error_response(err)
    limit = eng.max_queued_requests
    if limit is not None and len(call.items) * n > limit - eng.counts()[1]:
        return json_response({"detail": QUEUE_FULL}, 503)  # before creating any request
    await state.not_paused().wait()  # pause_generation: new generates block
    # SGLang holds the model-update reader lock from sending the request to its last
    # answer: an update to an unpaused server (the writer) waits for every generate
    await state.rw.acquire_reader()
    released = False

    async def release():
        nonlocal released
        if not released:
            released = True
            await state.rw.release_reader()
    response = None
    try:
        response = await submit_and_answer(state, request, call, release)
        return response
    finally:
        if not isinstance(response, StreamingResponse):  # a stream releases at its end
            await release()


async def submit_and_answer(state: ServerState, request, call: proto.GenerateCall, release):
    eng = state.engine
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def notify(index, req):
        def on_event(kind: str) -> None:
            if kind == "finish" or call.stream:
                loop.call_soon_threadsafe(queue.put_nowait, (index, kind))
        return on_event

    try:
        expanded = expand(state, call, notify)
        warmed = await warm_prefixes(state, request, expanded)
        if warmed is not None:
            return warmed
        eng.submit([r for r, _, _ in expanded])
    except ValueError as err:
        return error_response(err)
    except QueueFull:
        return json_response({"detail": QUEUE_FULL}, 503)
    except RuntimeError as err:
        return json_response(proto.value_error_body(str(err)), 503)
    if call.stream:
        return StreamingResponse(stream(state, request, call, expanded, queue, release),
                                 media_type="text/event-stream")
    if not await all_finished(state, request, queue, [r.rid for r, _, _ in expanded]):
        return Response(status_code=499)
    bodies = [response(state, r, plen, call, item) for r, item, plen in expanded]
    return json_response(bodies if call.is_batch else bodies[0])


def expand(state: ServerState, call: proto.GenerateCall,
           notify) -> list[tuple[EngineRequest, proto.ItemSpec, int]]:
    """One (request, its item, prompt length) per sample of every item; ``notify(index, req)``
    gives each request its ``on_event``."""
    expanded = []
    for item in call.items:
        ids = item.input_ids if item.input_ids is not None else state.engine.encode(item.text)
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


async def warm_prefixes(state: ServerState, request, expanded):
    """SGLang's parallel sampling (``n > 1``, TokenizerManager ``_handle_batch_request``):
    each prompt first goes alone with ``max_new_tokens`` 0 ("Cache the common prefix for
    parallel sampling"), answered before its samples are sent, so each sample finds
    ``len(input_ids) - 1`` of its tokens in the prefix cache. The warm-up has a fresh rid
    and a fixed seed (it samples nothing, so it draws nothing from ``--random-seed``'s
    stream). Returns a response only when the client went away (499)."""
    eng = state.engine
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
    if not await all_finished(state, request, done, [r.rid for r in warm]):
        return Response(status_code=499)
    return None


async def all_finished(state: ServerState, request, events: asyncio.Queue,
                       rids: list[str]) -> bool:
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
                    state.engine.abort(rid)
                return False
    return True


def response(state: ServerState, r: EngineRequest, prompt_len: int, call: proto.GenerateCall,
             item: proto.ItemSpec) -> dict:
    """SGLang's answer for a finished request (its final chunk when streamed)."""
    eng = state.engine
    meta: dict[str, Any] = {"id": r.rid, "finish_reason": r.finish}
    queued_abort = r.finish.get("message") == "Abort in waiting queue"
    text_lp = call.return_text_in_logprobs and eng.tokenizer is not None

    def triple(lp, tok):
        return [lp, tok, eng.decode([tok], skip_special_tokens=False) if text_lp else None]

    if not queued_abort:
        meta["prompt_tokens"] = prompt_len
    meta["weight_version"] = state.reported_weight_version  # the TokenizerManager's
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
        out["text"] = text(state, r)
    out["output_ids"] = list(r.output_ids)
    out["meta_info"] = meta
    if call.return_prompt_token_ids:
        out["prompt_token_ids"] = list(r.input_ids)
    return out


def text(state: ServerState, r: EngineRequest) -> str:
    """The output's text as SGLang answers it (a matched stop token / string trimmed unless
    ``no_stop_trim``)."""
    s, ids = r.sampling, list(r.output_ids)
    matched = (r.finish or {}).get("matched") if (r.finish or {}).get("type") == "stop" else None
    if isinstance(matched, int) and not s.no_stop_trim and ids:
        ids = ids[:-1]
    out = state.engine.decode(ids, skip_special_tokens=s.skip_special_tokens) or ""
    if isinstance(matched, str) and matched in out:
        cut = out.index(matched)
        out = out[: cut + len(matched)] if s.no_stop_trim else out[:cut]
    return out


async def stream(state: ServerState, request, call, expanded, queue, release=None):
    """SSE, cumulative chunks (SGLang's default), ``data: [DONE]`` at the end."""
    remaining = len(expanded)
    try:
        while remaining:
            try:
                index, kind = await asyncio.wait_for(queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    for r, _, _ in expanded:
                        state.engine.abort(r.rid)
                    return
                continue
            r, item, plen = expanded[index]
            if kind == "finish":
                remaining -= 1
                chunk = response(state, r, plen, call, item)
            else:
                if r.finished:
                    continue  # the finish event carries the final chunk
                chunk = partial(state, r, plen, item)
            if call.is_batch:
                chunk["index"] = index
            yield b"data: " + render_json(chunk) + b"\n\n"  # NaN / inf: null
        yield "data: [DONE]\n\n"
    finally:
        for r, _, _ in expanded:
            if not r.finished:
                state.engine.abort(r.rid)
        if release is not None:
            await release()


def partial(state: ServerState, r: EngineRequest, plen: int, item: proto.ItemSpec) -> dict:
    """A streamed chunk of a request still running: its output so far."""
    eng = state.engine
    n = len(r.output_ids)  # snapshot: the engine thread may append meanwhile
    chunk: dict[str, Any] = {}
    if eng.tokenizer is not None:
        chunk["text"] = eng.decode(r.output_ids[:n]) or ""
    chunk["output_ids"] = list(r.output_ids[:n])
    meta: dict[str, Any] = {"id": r.rid, "finish_reason": None, "prompt_tokens": plen,
                            "weight_version": state.reported_weight_version,
                            "completion_tokens": n, "cached_tokens": r.cached_tokens,
                            "cached_tokens_details": cached_tokens_details(r.cached_tokens)}
    if item.return_logprob:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                         zip(r.output_logprobs[:n], r.output_ids[:n])]
    chunk["meta_info"] = meta
    return chunk
