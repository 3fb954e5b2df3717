"""Weight routes: the session (``/begin_weight_update``, ``/end_weight_update``), the three updates
(``/update_weights_from_disk``, ``_tensor``, ``_distributed``), the update groups, the version
(``/update_weight_version``) and the checks (``/get_weights_by_name``, ``/weights_checker``).

Every route is one shape, written once in :func:`weight_route`: the body parsed as its io_struct
class (a refused body is a 400, :func:`~pipeline.local.bodies.error_response`), then, for what
SGLang asserts ``dp_size == 1`` on, a server with replicas answers the plain 500. An update then
runs as the TokenizerManager runs it (:meth:`ServerState.locked`) and its
:class:`~pipeline.local.state.UpdateOutcome` becomes the answer in
:meth:`ServerState.update_answer`, with the negotiated extensions' keys. :func:`register` adds
the routes to the app.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import time
from typing import Awaitable, Callable, Optional

from fastapi import FastAPI, Request

from pipeline.local import protocol as proto
from pipeline.local.bodies import error_response, json_response, read_body
from pipeline.local.state import ServerState, UpdateOutcome
from pipeline.local.tp_ranks import join_group, receive
from pipeline.weights import transport as wt

Handler = Callable[[ServerState, Request, dict], Awaitable]


def weight_route(request_class: str, *, required: bool = True, replicas: Optional[str] = None,
                 check: Optional[Callable[[dict], None]] = None) -> Callable[[Handler], Callable]:
    """The endpoint of ``handler(state, request, obj)``: ``obj`` is the body parsed as
    ``io_struct.<request_class>`` (``required``: an empty body is refused) and checked by
    ``check`` (raising ``ValueError``), both a 400 in SGLang's shape; with ``replicas`` (what
    SGLang names in its assertion) a server with ``dp_size > 1`` answers its plain 500 before
    the handler runs."""
    def endpoint_of(handler: Handler) -> Callable:
        async def endpoint(request: Request):
            state: ServerState = request.app.state.server
            try:
                obj = proto.parse_control(await read_body(request, required=required),
                                          request_class)
                if check is not None:
                    check(obj)
            except ValueError as err:
                return error_response(err)
            if replicas is not None and state.dp_size != 1:
                return state.replicas_unsupported(replicas)
            return await handler(state, request, obj)
        endpoint.__name__ = endpoint.__qualname__ = handler.__name__  # the route's name
        return endpoint
    return endpoint_of


def register(app: FastAPI) -> None:
    app.post("/begin_weight_update")(begin_weight_update)
    app.post("/end_weight_update")(end_weight_update)
    app.post("/update_weights_from_disk")(update_weights_from_disk)
    app.post("/update_weights_from_tensor")(update_weights_from_tensor)
    app.post("/init_weights_update_group")(init_weights_update_group)
    app.post("/update_weights_from_distributed")(update_weights_from_distributed)
    app.post("/destroy_weights_update_group")(destroy_weights_update_group)
    app.post("/update_weight_version")(update_weight_version)
    app.api_route("/get_weights_by_name", methods=["GET", "POST"])(get_weights_by_name)
    app.api_route("/weights_checker", methods=["GET", "POST"])(weights_checker)


async def wants_delta(request: Request, ext: set) -> bool:
    """Whether the body asks for a bf16 delta push (read only when ``delta`` was negotiated;
    without it ``delta`` is an ignored unknown field)."""
    return "delta" in ext and bool((await read_body(request)).get("delta"))


def abort_if_asked(state: ServerState, obj: dict) -> None:
    """``abort_all_requests``: every request aborted before the update waits for the lock."""
    if obj["abort_all_requests"]:
        state.engine.abort(abort_all=True)


# ------------------------------------------------------------------ session
@weight_route("BeginWeightUpdateReqInput")
async def begin_weight_update(state: ServerState, request: Request, obj: dict):
    async def begin() -> tuple[bool, str]:
        if state.session is not None:
            return False, proto.SESSION_ALREADY_OPEN
        state.session = obj["selector"]
        return True, "Success"
    success, message = await state.locked(begin)
    return state.answer(success, state.fan_out(message), set())


@weight_route("EndWeightUpdateReqInput")
async def end_weight_update(state: ServerState, request: Request, obj: dict):
    async def end() -> tuple[bool, str]:
        if state.session is None:
            return False, proto.NO_SESSION_OPEN
        state.session = None
        return True, "Success"
    success, message = await state.locked(end)
    return state.answer(success, state.fan_out(message), set())


# ------------------------------------------------------------------ updates
@weight_route("UpdateWeightFromDiskReqInput")
async def update_weights_from_disk(state: ServerState, request: Request, obj: dict):
    ext = state.negotiated(request)
    path, version = obj["model_path"], obj["weight_version"]
    paused_counts = 0 if state.num_dp_ranks == 1 else [0] * state.num_dp_ranks
    if obj["load_format"] not in (None, "auto", "safetensors"):
        return state.answer(False, f"load_format {obj['load_format']!r} is not supported by "
                            "the local server (auto / safetensors)", ext,
                            num_paused_requests=paused_counts)
    abort_if_asked(state, obj)
    outcome = await state.locked(functools.partial(disk_update, state, path, version,
                                                   obj["flush_cache"]))
    if outcome.success:  # the TokenizerManager's _update_model_path_info
        state.reported_model_path = path
        state.reported_load_format = obj["load_format"] or "auto"
    return state.update_answer(outcome, version, ext, num_paused_requests=paused_counts)


async def disk_update(state: ServerState, path: str, version, flush: bool) -> UpdateOutcome:
    """``update_weights_from_disk`` under the lock: the directory checked, then every TP rank
    reads its shards (rank 0 on the engine thread), records ``version`` and flushes."""
    # keep_pause, is_async, token_step, manifest, recapture_cuda_graph: accepted and
    # unused, as in 0.5.23 (no code there reads keep_pause or is_async; a disk
    # update never changes the pause state)
    eng = state.engine
    try:  # checked first: a refused directory changes nothing on any TP rank
        await asyncio.to_thread(state.check_weight_dir, path)
    except Exception as err:  # noqa: BLE001 - every refusal is an answer, never a 500
        return UpdateOutcome(False, f"Failed to update weights: {err}. The weights are "
                                    "unchanged.")
    try:
        t0 = time.perf_counter()
        others = state.on_workers("disk", [{"path": path}] * len(state.tp_workers))

        def load():
            sums = eng.weights.load_shards(path)
            return sums, state.after_update(version, flush)
        sums, (ok, refusal) = await asyncio.wrap_future(eng.call(load))
        sums_others = await state.results(others)
        timings = {"load_s": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001 - reported in the body
        return UpdateOutcome(False, f"Failed to update weights: {err}")
    checksums = {f: [d, *(o[f] for o in sums_others)] for f, d in sums.items()}
    if not ok:
        return UpdateOutcome(False, refusal, checksums, timings)
    return UpdateOutcome(True, "Succeeded to update model weights.", checksums, timings)


@weight_route("UpdateWeightsFromTensorReqInput",
              replicas="update weights from tensor")
async def update_weights_from_tensor(state: ServerState, request: Request, obj: dict):
    ext = state.negotiated(request)
    delta = await wants_delta(request, ext)
    version = obj["weight_version"]
    abort_if_asked(state, obj)
    outcome = await state.locked(functools.partial(tensor_update, state, obj, delta))
    return state.update_answer(outcome, version, ext)


def tensor_refusal(state: ServerState, obj: dict) -> tuple[Optional[str], bool]:
    """(why ``update_weights_from_tensor`` is refused before anything is loaded, or None;
    whether its payloads are pickles, SGLang's ``MultiprocessingSerializer``)."""
    payloads = obj["serialized_named_tensors"]
    if state.session is None:
        return proto.OUTSIDE_SESSION.format("update_weights_from_tensor"), False
    if not payloads:
        return ("serialized_named_tensors: expected a list with one base64 string per TP "
                "rank"), False
    try:
        raw = base64.b64decode(payloads[0], validate=True)
    except (ValueError, TypeError) as err:
        return f"serialized_named_tensors: not base64 ({err})", False
    pickled = wt.looks_like_pickle(raw)
    if pickled and not state.args_allow_pickle:
        return ("serialized_named_tensors: a pickled payload (SGLang's "
                "MultiprocessingSerializer) is refused: this server reads "
                "base64 safetensors unless started with "
                "--allow-pickled-tensors (127.0.0.1 only)"), pickled
    if obj["load_format"] not in (None, "direct"):
        return (f"load_format {obj['load_format']!r}: the local server reads "
                "named tensors (load_format null or 'direct')"), pickled
    if pickled and len(payloads) != state.tp_size:
        return (f"serialized_named_tensors: {len(payloads)} entries for a "
                f"server with tp_size {state.tp_size} (one per TP rank)"), pickled
    return None, pickled


async def tensor_update(state: ServerState, obj: dict, delta: bool) -> UpdateOutcome:
    """``update_weights_from_tensor`` under the lock: the payloads checked
    (:func:`tensor_refusal`), decoded, loaded on every TP rank."""
    refusal, pickled = tensor_refusal(state, obj)
    if refusal is not None:
        return UpdateOutcome(False, refusal)
    payloads = obj["serialized_named_tensors"]
    try:
        if pickled:  # each TP rank deserialises its own entry, as SGLang's do
            others = state.on_workers("tensor", [
                {"payload": payloads[i + 1], "delta": delta}
                for i in range(len(state.tp_workers))])
            t0 = time.perf_counter()
            named = await asyncio.to_thread(lambda: list(state.impl.deserialize(payloads[0])))
            state.mapped.keep(named)
        else:
            t0 = time.perf_counter()
            named = list((await asyncio.to_thread(wt.decode_named_tensors,
                                                  payloads[0])).items())
            others = state.on_workers("named", [{"named": named, "delta": delta}]
                                      * len(state.tp_workers))
        t1 = time.perf_counter()
        checksum, (ok, refusal) = await state.apply_and_check(named, delta, obj["weight_version"],
                                                              obj["flush_cache"])
        checksums = [checksum, *(await state.results(others))]
        timings = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
    except Exception as err:  # noqa: BLE001 - a malformed payload is an answer
        return UpdateOutcome(False, f"Failed to update weights: {type(err).__name__}: {err}")
    if not ok:
        return UpdateOutcome(False, refusal, checksums, timings)
    return UpdateOutcome(True, "Success", checksums, timings)


# ------------------------------------------------------------------ update groups and their updates
@weight_route("InitWeightsUpdateGroupReqInput",
              replicas="update weights from distributed")
async def init_weights_update_group(state: ServerState, request: Request, obj: dict):
    addr, port = obj["master_address"], obj["master_port"]
    rank, world = obj["rank_offset"], obj["world_size"]
    name, backend = obj["group_name"], obj["backend"]
    if not 1 <= rank < world:
        return state.failed(state.fan_out(
            f"Failed to initialize custom process group: rank_offset {rank} with "
            f"world_size {world}: this server joins at ranks 1 .. world_size - 1; "
            "rank 0 (the trainer) hosts the group's store"))
    if backend != "gloo":
        return state.failed(state.fan_out(f"Failed to initialize custom process group: backend "
                                          f"{backend!r}: the local server runs on the CPU, use "
                                          "'gloo'"))
    if name in state.groups:
        return state.failed(state.fan_out(f"Failed to initialize custom process group: {name!r} "
                                          "exists"))
    timeout = state.args.weight_update_timeout
    try:  # rank_offset + tp_rank for every TP rank, all at once (they meet in one group)
        others = state.on_workers("init_group", [
            {"address": addr, "port": port, "rank": rank + i + 1, "world": world,
             "name": name, "backend": backend, "timeout_s": timeout}
            for i in range(len(state.tp_workers))])
        group = await asyncio.to_thread(join_group, state.impl, addr, port, rank, world,
                                        name, backend, timeout)
        await state.results(others)
    except Exception as err:  # noqa: BLE001 - reported in the body
        return state.failed(state.fan_out(f"Failed to initialize custom process group: {err}"))
    state.groups[name] = group
    return {"success": True,
            "message": state.fan_out("Succeeded to initialize custom process group.")}


def check_tensor_specs(obj: dict) -> None:
    """``names``, ``dtypes`` and ``shapes`` of a distributed update: one each per tensor, every
    dtype one the transport knows."""
    names, dtypes, shapes = obj["names"], obj["dtypes"], obj["shapes"]
    if not (len(names) == len(dtypes) == len(shapes)):
        raise proto.ParseError("names, dtypes and shapes must have the same length")
    for d in dtypes:
        wt.parse_dtype(d)


@weight_route("UpdateWeightsFromDistributedReqInput",
              replicas="update weights from distributed", check=check_tensor_specs)
async def update_weights_from_distributed(state: ServerState, request: Request, obj: dict):
    ext = state.negotiated(request)
    delta = await wants_delta(request, ext)
    version = obj["weight_version"]
    abort_if_asked(state, obj)
    outcome = await state.locked(functools.partial(distributed_update, state, obj, delta))
    return state.update_answer(outcome, version, ext)


async def distributed_update(state: ServerState, obj: dict, delta: bool) -> UpdateOutcome:
    """``update_weights_from_distributed`` under the lock: one bucket received over the update
    group (every TP rank), then loaded."""
    names, dtypes, shapes = obj["names"], obj["dtypes"], obj["shapes"]
    name, load_format = obj["group_name"], obj["load_format"]

    def receive_all(group):
        # One broadcast at a time, in arrival order (SGLang's writer lock). The lock is
        # held for the receive only: loading bucket k overlaps receiving bucket k+1.
        with state.group_lock:
            others = state.on_workers("distributed", [
                {"name": name, "names": names, "dtypes": dtypes, "shapes": shapes,
                 "load_format": load_format, "delta": delta}] * len(state.tp_workers))
            return receive(state.impl, group, names, dtypes, shapes, load_format,
                           state.receive_buffers), others

    if state.session is None:
        return UpdateOutcome(False, proto.OUTSIDE_SESSION.format("update_weights_from_distributed"))
    group = state.groups.get(name)
    if group is None:
        return UpdateOutcome(False, f"Failed to receive weights: no group {name!r}; call "
                                    "/init_weights_update_group first")
    buf = None
    try:
        t0 = time.perf_counter()
        try:
            (named, buf), others = await asyncio.to_thread(receive_all, group)
        except Exception as err:  # noqa: BLE001 - SGLang's message
            return UpdateOutcome(False, f"Failed to receive weights: {err}")
        t1 = time.perf_counter()
        checksum, (ok, refusal) = await state.apply_and_check(named, delta, obj["weight_version"],
                                                              obj["flush_cache"])
        checksums = [checksum, *(await state.results(others))]
        timings = {"receive_s": t1 - t0, "load_s": time.perf_counter() - t1}
    except Exception as err:  # noqa: BLE001 - reported in the body
        return UpdateOutcome(False, f"Failed to update parameter online: {err}")
    finally:
        if buf is not None:  # loaded (or failed): the buffer takes the next bucket
            state.receive_buffers.release(buf)
    if not ok:
        return UpdateOutcome(False, refusal, checksums, timings)
    return UpdateOutcome(True, "Succeeded to update parameter online.", checksums, timings)


@weight_route("DestroyWeightsUpdateGroupReqInput",
              required=False, replicas="destroy parameter update group")
async def destroy_weights_update_group(state: ServerState, request: Request, obj: dict):
    name = obj["group_name"]
    group = state.groups.pop(name, None)
    if group is None:
        return state.failed(state.fan_out(f"no group {name!r}"))
    await state.results(state.on_workers("destroy_group",
                                         [{"name": name}] * len(state.tp_workers)))
    wt.destroy_group(group)
    return {"success": True,
            "message": state.fan_out("Succeeded to destroy custom process group.")}


# ------------------------------------------------------------------ version and checks
@weight_route("UpdateWeightVersionReqInput")
async def update_weight_version(state: ServerState, request: Request, obj: dict):
    eng = state.engine
    version = obj["new_version"]
    abort_if_asked(state, obj)  # SGLang's default: True

    def set_version():
        eng.apply_pending_aborts()  # the scheduler takes the AbortReq first
        eng.set_weight_version(version)
    try:
        await asyncio.wrap_future(eng.call(set_version))
    except Exception as err:  # noqa: BLE001 - SGLang's failure body
        return state.failed(f"Failed to update weight version: {err}")
    state.reported_weight_version = version
    return {"success": True, "message": f"Weight version updated to {version}",
            "new_version": version}


async def get_weights_by_name(request: Request):
    eng = request.app.state.server.engine
    try:
        body = await read_body(request, required=True)
        name, limit = body["name"], int(body.get("truncate_size", 100))
        tensor = await asyncio.wrap_future(eng.call(lambda: eng.weights.get(name)))
    except Exception:  # noqa: BLE001 - SGLang's message
        return json_response(proto.value_error_body("Get parameter by name failed"), 400)
    return json_response(tensor.float().tolist()[:limit])


async def weights_checker(request: Request):
    state: ServerState = request.app.state.server
    try:
        body = await read_body(request)
    except ValueError as err:
        return error_response(err)
    action = body.get("action", "checksum")
    if action != "checksum":
        return state.failed(f"action {action!r}: the local server implements 'checksum'")
    others = state.on_workers("checksum", [{}] * len(state.tp_workers))
    digest = await asyncio.wrap_future(state.engine.call(state.engine.weights.checksum))
    return {"success": True, "message": digest, "checksum": digest,
            "per_engine_checksum": [digest],
            "per_tp_rank_checksum": [digest, *(await state.results(others))]}
