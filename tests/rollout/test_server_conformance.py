"""The local rollout server enforces what SGLang 0.5.23 enforces, by default (issue 20, item 3).

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_server_conformance.py``

Every rule is read from the sglang 0.5.23 wheel (``tests/sglang_wheel.py``: fetched into the
cache, never installed) and checked against an in-process ``megatron-gspo serve`` on a tiny
random Qwen3-MoE:

* the paths it serves (``@app`` routes of ``srt/entrypoints/http_server.py`` and its routers),
  everything else a 404;
* the request classes (``io_struct``): every field, every default;
* SGLang's answers, word for word (weight-update sessions, flush refusals, pause / continue);
* weight-update sessions, the flush rules by pause mode, the flush after an update, the
  model-update writer lock of an unpaused server, retract and recompute;
* ``meta_info.weight_versions`` against SGLang's own ``compute_weight_version_spans`` /
  ``add_weight_versions_to_meta_info``, run from the wheel;
* the extensions (checksums, delta, timings) only where a request negotiated them;
* the data-parallel layout as ``handle_deprecated_dp_attention`` (run from the wheel) resolves
  it, and ``dp_size > 1`` refusing what SGLang's asserts refuse.
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import sys
import threading
import time
import types
import urllib.request
import zipfile

import pytest
import torch

from pipeline.local import protocol as proto
from pipeline.local.args import resolve_dp_layout
from pipeline.generation.client import http_json
from pipeline.weights.transport import delta_encode, encode_named_tensors
from tests import sglang_rules
from tests.rollout.conftest import InProcessServer
from tests.sglang_wheel import SGLANG_VERSION, cache_dir, read_member, wheel

WEIGHT = "model.layers.1.mlp.experts.2.up_proj.weight"
EXT = proto.EXTENSIONS_HEADER
N_LONG = 250  # the tiny model has 256 positions
LONG = {"sampling_params": {"max_new_tokens": N_LONG, "ignore_eos": True, "temperature": 0.0}}


# ------------------------------------------------------------------ reading the wheel
@functools.lru_cache(maxsize=None)
def _tree(member: str) -> ast.Module:
    return ast.parse(read_member(member).decode())


def _strings(member: str) -> set[str]:
    """Every string constant of a wheel module (implicit concatenations joined, as Python does)."""
    return {n.value for n in ast.walk(_tree(member))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _function(member: str, name: str) -> ast.AST:
    for node in ast.walk(_tree(member)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    raise AssertionError(f"sglang {SGLANG_VERSION}: no function {name} in {member}")


def _router_routes(member: str) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for node in _tree(member).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "router"):
                    out.setdefault(dec.args[0].value, set()).add(dec.func.attr.upper())
    return out


@pytest.fixture(scope="session")
def sglang_weight_versions():
    """SGLang's own ``srt/utils/weight_versions.py`` (it needs only msgspec and its
    ``msgspec_utils``), imported from a subset package cut from the wheel."""
    root = cache_dir() / f"sglang-{SGLANG_VERSION}-weight-versions-subset"
    files = ("sglang/srt/utils/weight_versions.py", "sglang/srt/utils/msgspec_utils.py")
    if not (root / files[0]).is_file():
        tmp = root.with_name(root.name + ".tmp")
        with zipfile.ZipFile(wheel()) as whl:
            for pkg in ("sglang", "sglang/srt", "sglang/srt/utils"):
                (tmp / pkg).mkdir(parents=True, exist_ok=True)
                (tmp / pkg / "__init__.py").write_text("")
            for f in files:
                (tmp / f).write_bytes(whl.read(f))
        tmp.rename(root)
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        module = importlib.import_module("sglang.srt.utils.weight_versions")
        assert module.__file__.startswith(str(root))
        yield module
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def sglang_meta(wv, events, current, num_output) -> dict:
    """What 0.5.23 puts in meta_info for a finished request (scheduler + TokenizerManager)."""
    spans = wv.compute_weight_version_spans(
        [wv.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in events],
        current_version=current, num_output_tokens=num_output)
    meta = {"weight_version": "tokenizer's"}
    wv.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=num_output)
    return meta


# ------------------------------------------------------------------ talking to the server
def post(server, path, body, headers=None, timeout_s=120):
    return http_json("POST", server.url + path, body, timeout_s=timeout_s, headers=headers)


def loads(server):
    return http_json("GET", server.url + "/v1/loads")[1]["loads"][0]


def wait_for(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def in_background(server, body):
    """POST /generate in a thread; returns (thread, result dict: "answer", "done_at")."""
    out = {}

    def run():
        out["answer"] = post(server, "/generate", body)[1]
        out["done_at"] = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


class Stream:
    """A streamed /generate read in a thread; ``lengths``: output_ids length of every chunk."""

    def __init__(self, server, body):
        self.lengths, self.final = [], None
        data = json.dumps({**body, "stream": True}).encode()
        self.req = urllib.request.Request(server.url + "/generate", data=data,
                                          headers={"Content-Type": "application/json"})
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        with urllib.request.urlopen(self.req, timeout=120) as resp:
            for line in resp:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    self.lengths.append(len(chunk["output_ids"]))
                    if chunk["meta_info"]["finish_reason"] is not None:
                        self.final = chunk

    def join(self):
        self.thread.join(120)
        assert self.final is not None, "the stream did not finish"
        return self.final


def tensor_update(server, value, **fields):
    payload = encode_named_tensors([(WEIGHT, value)])
    return post(server, "/update_weights_from_tensor",
                {"serialized_named_tensors": [payload], **fields})


def weight(server):
    return torch.tensor(post(server, "/get_weights_by_name",
                             {"name": WEIGHT, "truncate_size": 10 ** 6})[1])


@pytest.fixture
def server(model_dir):
    """A fresh server per test: sessions, pause state and versions never leak between tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    s = InProcessServer(model_dir)
    yield s
    s.close()
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ static rules
def test_served_paths_are_sglangs_and_every_other_path_is_a_404(server, model_dir):
    sglang = {p: set(m) for p, m in sglang_rules.routes().items()}
    for member in ("sglang/srt/entrypoints/v1_loads.py", "sglang/srt/entrypoints/elastic_ep.py"):
        for p, m in _router_routes(member).items():  # app.include_router(...)
            sglang.setdefault(p, set()).update(m)
    # FastAPI's own pages: SGLang's FastAPI() keeps the defaults (openapi_url "/openapi.json")
    fastapi_defaults = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    ours = {}
    for route in server.server.app.routes:
        ours.setdefault(route.path, set()).update(getattr(route, "methods", None) or {"GET"})
    for path, methods in ours.items():
        if path in fastapi_defaults:
            continue
        assert path in sglang, f"{path}: served here, not by SGLang {SGLANG_VERSION}"
        assert methods - {"HEAD"} <= sglang[path], f"{path}: {methods} vs SGLang's {sglang[path]}"
    # what earlier versions of this server answered and SGLang 0.5.23 does not
    assert "/get_load" not in sglang and "/metrics" not in sglang
    for path in ("/get_load", "/metrics", "/no_such_path"):
        assert http_json("GET", server.url + path)[0] == 404, path
    # /metrics only with --enable-metrics (SGLang's add_prometheus_middleware mounts it then)
    source = read_member("sglang/srt/utils/common.py").decode()
    assert 'Mount("/metrics"' in source
    metrics = InProcessServer(model_dir, enable_metrics=True)
    try:
        assert http_json("GET", metrics.url + "/metrics")[0] == 200
    finally:
        metrics.close()


ENDPOINT_CLASSES = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}


def test_control_bodies_take_every_io_struct_field_with_sglangs_default(server):
    assert {p: sglang_rules.body_classes()[p] for p in ENDPOINT_CLASSES} == ENDPOINT_CLASSES
    assert set(proto.CONTROL_REQUESTS) == set(ENDPOINT_CLASSES.values())
    for cls in proto.CONTROL_REQUESTS:
        wheel_fields = sglang_rules.fields(cls)
        ours = {**proto.BASE_REQ_FIELDS, **proto.CONTROL_REQUESTS[cls]}
        assert list(ours) == list(wheel_fields) or set(ours) == set(wheel_fields), cls
        for name, default in wheel_fields.items():
            if default is None:
                assert ours[name] is proto.REQUIRED, f"{cls}.{name}: required in SGLang"
            else:
                assert ours[name] == ast.literal_eval(default), f"{cls}.{name}: {default}"
    # every field accepted at once, unknown ones ignored (extra_behavior="ignore")
    every = {"model_path": str(server.server.engine.model_path), "load_format": None,
             "abort_all_requests": False, "weight_version": "all-fields", "is_async": False,
             "torch_empty_cache": False, "keep_pause": True, "recapture_cuda_graph": False,
             "token_step": 3, "flush_cache": True, "manifest": {"x": 1}, "rid": None,
             "http_worker_ipc": None, "no_such_field": [1, 2]}
    assert set(every) - {"no_such_field"} == set(sglang_rules.fields(
        "UpdateWeightFromDiskReqInput"))
    status, answer = post(server, "/update_weights_from_disk", every)
    assert status == 200 and answer == {
        "success": True, "num_paused_requests": 0,
        "message": "Succeeded to update model weights. Weight version updated to all-fields."}
    # a missing required field / a bad literal: SGLang's RequestValidationError shape, 400
    for path, body in (("/update_weights_from_disk", {}),
                       ("/begin_weight_update", {"selector": "everything"}),
                       ("/pause_generation", {"mode": "sideways"}),
                       ("/update_weight_version", {"abort_all_requests": False})):
        status, answer = post(server, path, body)
        assert status == 400 and answer["object"] == "error" and answer["code"] == 400, path


def test_answers_are_sglangs_word_for_word():
    updater = _strings("sglang/srt/managers/scheduler_components/weight_updater.py")
    for text in (proto.SESSION_ALREADY_OPEN, proto.NO_SESSION_OPEN, proto.FLUSH_REFUSED_AFTER_UPDATE,
                 proto.OUTSIDE_SESSION.format("update_weights_from_distributed"),
                 proto.OUTSIDE_SESSION.format("update_weights_from_tensor"),
                 "Success", "Succeeded to update model weights.",
                 "Succeeded to update parameter online."):
        assert text in updater, text
    flush = _strings("sglang/srt/managers/scheduler_components/flush_wrapper.py")
    assert proto.FLUSH_BUSY in flush and proto.FLUSH_TIMED_OUT in flush
    http = _strings(sglang_rules.HTTP_SERVER)
    for text in (proto.FLUSH_OK, proto.FLUSH_FAILED, "Generation paused successfully.",
                 "Generation continued successfully.", "ok"):
        assert text in http, text
    assert " | " in _strings("sglang/srt/managers/communicator.py")  # merge_results' joiner


# ------------------------------------------------------------------ sessions and flush rules
def test_weight_update_sessions(server):
    new = torch.randn(weight(server).shape)
    status, answer = tensor_update(server, new)
    assert (status, answer) == (400, {"success": False, "message": proto.OUTSIDE_SESSION.format(
        "update_weights_from_tensor")})
    status, answer = post(server, "/update_weights_from_distributed", {
        "names": [WEIGHT], "dtypes": ["float32"], "shapes": [list(new.shape)]})
    assert (status, answer) == (400, {"success": False, "message": proto.OUTSIDE_SESSION.format(
        "update_weights_from_distributed")})
    assert not torch.equal(weight(server), new)  # refused: nothing loaded
    assert post(server, "/end_weight_update", {}) == (
        400, {"success": False, "message": proto.NO_SESSION_OPEN})
    assert post(server, "/begin_weight_update", {"selector": "all"}) == (
        200, {"success": True, "message": "Success"})
    assert post(server, "/begin_weight_update", {"selector": "all"}) == (
        400, {"success": False, "message": proto.SESSION_ALREADY_OPEN})
    status, answer = tensor_update(server, new, weight_version="s1")
    assert (status, answer) == (200, {"success": True,
                                      "message": "Success Weight version updated to s1."})
    assert torch.equal(weight(server), new)
    assert post(server, "/end_weight_update", {}) == (200, {"success": True, "message": "Success"})
    # disk updates need no session
    status, answer = post(server, "/update_weights_from_disk",
                          {"model_path": str(server.server.engine.model_path)})
    assert status == 200 and answer["success"] is True


def test_flush_rules_follow_the_pause_mode(server):
    t, out = in_background(server, {"input_ids": [40, 41], **LONG})
    wait_for(lambda: loads(server)["num_running_reqs"] == 1)
    # in_place: the requests keep their KV -> refused; an update's own flush too
    assert post(server, "/pause_generation", {"mode": "in_place"})[1] == {
        "message": "Generation paused successfully.", "status": "ok"}
    assert loads(server)["num_running_reqs"] == 1
    assert post(server, "/flush_cache", {}) == (400, proto.FLUSH_FAILED)
    assert post(server, "/begin_weight_update", {})[0] == 200
    new = torch.randn(weight(server).shape)
    status, answer = tensor_update(server, new, weight_version="refused")
    assert (status, answer) == (400, {"success": False, "message": proto.FLUSH_REFUSED_AFTER_UPDATE})
    assert torch.equal(weight(server), new)  # "Weights were updated, but ..."
    model_info = http_json("GET", server.url + "/model_info")[1]
    assert model_info["weight_version"] == "default"  # the TokenizerManager's: success only
    # retract (straight from in_place, as SGLang's scheduler allows): running requests go back
    # to the waiting queue without their KV, and a paused engine ignores its waiting queue
    assert post(server, "/pause_generation", {"mode": "retract"})[0] == 200
    assert (loads(server)["num_running_reqs"], loads(server)["num_waiting_reqs"]) == (0, 1)
    status, text = post(server, "/flush_cache", {})
    assert (status, text) == (200, proto.FLUSH_OK)
    # the deferred flush (timeout > 0) waits for is_fully_idle() WITHOUT ignore_waiting
    status, text = http_json("POST", server.url + "/flush_cache?timeout=0.2", {})
    assert (status, text) == (400, proto.FLUSH_TIMED_OUT)
    status, answer = tensor_update(server, new)  # flush_cache defaults to True: it works now
    assert (status, answer) == (200, {"success": True, "message": "Success"})
    assert post(server, "/end_weight_update", {})[0] == 200
    assert post(server, "/continue_generation", {"torch_empty_cache": True})[1] == {
        "message": "Generation continued successfully.", "status": "ok"}
    t.join(120)
    assert out["answer"]["meta_info"]["num_retractions"] == 1
    assert len(out["answer"]["output_ids"]) == N_LONG
    # abort: in-flight requests come back aborted, then the flush works
    t, out = in_background(server, {"input_ids": [42], **LONG})
    wait_for(lambda: loads(server)["num_running_reqs"] == 1)
    assert post(server, "/pause_generation", {"mode": "abort"})[0] == 200
    t.join(60)
    assert out["answer"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert post(server, "/flush_cache", {}) == (200, proto.FLUSH_OK)
    assert post(server, "/continue_generation", {})[0] == 200


def test_an_update_to_an_unpaused_server_waits_for_every_inflight_request(server):
    body = {"input_ids": [43, 44], **LONG}
    t, out = in_background(server, body)
    wait_for(lambda: loads(server)["num_running_reqs"] == 1)
    status, answer = post(server, "/update_weights_from_disk", {
        "model_path": str(server.server.engine.model_path), "weight_version": "w1"})
    answered_at = time.monotonic()
    t.join(60)
    assert status == 200 and answer["success"] is True  # its flush found the server idle
    assert out["done_at"] <= answered_at  # the writer lock waited for the generate
    meta = out["answer"]["meta_info"]
    # without the lock the version would change mid-request: two spans
    assert len(out["answer"]["output_ids"]) == N_LONG
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": N_LONG}]
    assert http_json("GET", server.url + "/model_info")[1]["weight_version"] == "w1"


def test_keep_pause_is_accepted_and_unused_as_in_sglang(server):
    # 0.5.23 reads keep_pause (and is_async) nowhere but where io_struct declares them
    with zipfile.ZipFile(wheel()) as whl:
        users = [m for m in whl.namelist() if m.endswith(".py")
                 and b"keep_pause" in whl.read(m)]
    assert users == ["sglang/srt/managers/io_struct.py"]
    path = str(server.server.engine.model_path)
    assert post(server, "/pause_generation", {"mode": "retract"})[0] == 200
    for keep in (True, False):  # a disk update never changes the pause state
        assert post(server, "/update_weights_from_disk",
                    {"model_path": path, "keep_pause": keep})[0] == 200
        assert server.server.paused and server.server.engine.paused
    assert post(server, "/continue_generation", {})[0] == 200


# ------------------------------------------------------------------ weight versions
def test_span_functions_are_sglangs(sglang_weight_versions):
    from pipeline.local.request import add_weight_versions_to_meta_info, compute_weight_version_spans

    wv = sglang_weight_versions
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(0, 12, (1,), generator=gen))
        events = [(f"v{int(torch.randint(0, 3, (1,), generator=gen))}",
                   int(torch.randint(0, 14, (1,), generator=gen)))
                  for _ in range(int(torch.randint(0, 4, (1,), generator=gen)))]
        current = f"v{int(torch.randint(0, 3, (1,), generator=gen))}"
        shown = int(torch.randint(0, 14, (1,), generator=gen))
        theirs = wv.compute_weight_version_spans(
            [wv.WeightVersionEvent(old_version=v, num_output_tokens=k) for v, k in events],
            current_version=current, num_output_tokens=n)
        ours = compute_weight_version_spans(events, current, n)
        assert ours == [{"version": s.version, "start": s.start, "end": s.end} for s in theirs]
        a, b = {}, {}
        wv.add_weight_versions_to_meta_info(a, theirs, num_output_tokens=shown)
        add_weight_versions_to_meta_info(b, ours, shown)
        assert a == b


def test_weight_versions_of_live_retracted_and_aborted_requests(server, sglang_weight_versions):
    wv = sglang_weight_versions
    # 1. a running request across a version change (in_place pause, label only)
    stream = Stream(server, {"input_ids": [45, 46], "sampling_params": {
        "max_new_tokens": 40, "ignore_eos": True}})
    wait_for(lambda: stream.lengths and stream.lengths[-1] >= 3)
    assert post(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    time.sleep(0.3)
    k = stream.lengths[-1]
    assert post(server, "/update_weight_version",
                {"new_version": "v1", "abort_all_requests": False})[1] == {
        "success": True, "message": "Weight version updated to v1", "new_version": "v1"}
    assert post(server, "/continue_generation", {})[0] == 200
    meta = stream.join()["meta_info"]
    assert 0 < k < 40
    assert {key: meta[key] for key in ("weight_versions", "weight_version")} == \
        sglang_meta(wv, [("default", k)], "v1", 40)
    # 2. retracted: back to the waiting queue, recomputed on continue, events kept
    stream = Stream(server, {"input_ids": [45, 46], "sampling_params": {
        "max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0}})
    wait_for(lambda: stream.lengths and stream.lengths[-1] >= 3)
    assert post(server, "/pause_generation", {"mode": "retract"})[0] == 200
    time.sleep(0.3)
    k = stream.lengths[-1]
    assert post(server, "/update_weight_version",
                {"new_version": "v2", "abort_all_requests": False})[0] == 200
    assert post(server, "/continue_generation", {})[0] == 200
    final = stream.join()
    assert final["meta_info"]["num_retractions"] == 1
    assert final["meta_info"]["weight_versions"] == sglang_meta(
        wv, [("v1", k)], "v2", 40)["weight_versions"]
    # recomputed (prompt + output re-prefilled): the same greedy tokens as without a retract
    plain = post(server, "/generate", {"input_ids": [45, 46], "sampling_params": {
        "max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0}})[1]
    assert final["output_ids"] == plain["output_ids"]
    assert plain["meta_info"]["weight_versions"] == [{"version": "v2", "start": 0, "end": 40}]
    # 3. aborted by update_weight_version's default abort_all_requests=True
    stream = Stream(server, {"input_ids": [47], **LONG})
    wait_for(lambda: stream.lengths and stream.lengths[-1] >= 2)
    assert post(server, "/update_weight_version", {"new_version": "v3"})[0] == 200
    final = stream.join()
    meta = final["meta_info"]
    n = len(final["output_ids"])
    assert meta["finish_reason"]["type"] == "abort" and 0 < n < N_LONG
    assert {key: meta[key] for key in ("weight_versions", "weight_version")} == \
        sglang_meta(wv, [], "v2", n)  # aborted before the version changed
    # 4. no output at all: one empty span
    out = post(server, "/generate", {"input_ids": [48], "sampling_params": {"max_new_tokens": 0}})[1]
    assert out["meta_info"]["weight_versions"] == sglang_meta(wv, [], "v3", 0)["weight_versions"]


# ------------------------------------------------------------------ extensions
def test_extensions_only_where_negotiated(server, model_dir):
    info = http_json("GET", server.url + "/server_info")[1]
    assert info["implementation"] == "megatron-gspo local rollout server"
    assert info["megatron_gspo_extensions"] == ["checksums", "delta", "timings"]
    assert post(server, "/begin_weight_update", {})[0] == 200
    old = weight(server).to(torch.bfloat16)
    new = old.clone()
    new.view(-1)[:5] += 1.0
    full = encode_named_tensors([(WEIGHT, new)])
    # no header: SGLang's body exactly; "delta" is an unknown field
    status, answer = post(server, "/update_weights_from_tensor",
                          {"serialized_named_tensors": [full], "delta": True})
    assert (status, answer) == (200, {"success": True, "message": "Success"})
    newer = new.clone()
    newer.view(-1)[:3] += 1.0
    delta = encode_named_tensors(delta_encode(WEIGHT, newer, new))
    status, answer = post(server, "/update_weights_from_tensor",
                          {"serialized_named_tensors": [delta], "delta": True})
    assert status == 400 and "no such parameter" in answer["message"]  # not a delta to SGLang
    assert set(answer) == {"success", "message"}
    # negotiated: checksums (one per TP rank), timings, delta honoured
    status, answer = post(server, "/update_weights_from_tensor",
                          {"serialized_named_tensors": [delta], "delta": True},
                          headers={EXT: "checksums, delta,timings"})
    assert status == 200 and set(answer) == {"success", "message", "checksums", "timings"}
    assert len(answer["checksums"]) == server.server.tp_size
    assert torch.equal(weight(server).to(torch.bfloat16), newer)
    status, answer = post(server, "/update_weights_from_tensor",
                          {"serialized_named_tensors": [full]}, headers={EXT: "timings"})
    assert set(answer) == {"success", "message", "timings"}
    assert post(server, "/end_weight_update", {})[0] == 200
    status, answer = post(server, "/update_weights_from_disk", {"model_path": str(model_dir)},
                          headers={EXT: "checksums"})
    assert set(answer) == {"success", "message", "num_paused_requests", "checksums"}
    # --no-extensions: none offered, the header changes nothing
    plain = InProcessServer(model_dir, no_extensions=True)
    try:
        assert http_json("GET", plain.url + "/server_info")[1]["megatron_gspo_extensions"] == []
        assert post(plain, "/begin_weight_update", {})[0] == 200
        status, answer = post(plain, "/update_weights_from_tensor",
                              {"serialized_named_tensors": [full]},
                              headers={EXT: "checksums,delta,timings"})
        assert (status, answer) == (200, {"success": True, "message": "Success"})
    finally:
        plain.close()


# ------------------------------------------------------------------ data-parallel layout
def _sglang_resolution(server_args):
    """SGLang's own handle_deprecated_dp_attention (its source from the wheel), run with its
    config-view helpers reduced to attribute access."""
    fn = _function("sglang/srt/arg_groups/parallel_hook.py", "handle_deprecated_dp_attention")
    namespace = {"resolving_view": lambda a: a,
                 "declare_resolution": lambda a, source, **kw: [setattr(a, k, v)
                                                                for k, v in kw.items()],
                 "Any": object}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "parallel_hook.py", "exec"), namespace)
    namespace["handle_deprecated_dp_attention"](server_args)
    return server_args


def test_dp_layout_is_resolved_and_reported_as_sglang_does(model_dir):
    resolved_dict = ast.unparse(_function("sglang/srt/server_args.py", "resolved_dict"))
    assert "resolved['enable_dp_attention'] = resolving_view(self).attn_dp_size > 1" \
        in resolved_dict  # /server_info reports the deprecated flag true with attention DP
    for dp, attn, flag, tp in ((4, 1, True, 4), (2, 1, False, 2), (1, 2, False, 2),
                               (3, 1, True, 3), (1, 1, True, 1), (1, 2, True, 2)):
        theirs = _sglang_resolution(types.SimpleNamespace(
            dp_size=dp, attn_dp_size=attn, enable_dp_attention=flag))
        assert resolve_dp_layout(dp, attn, flag, tp) == (theirs.dp_size, theirs.attn_dp_size)
    with pytest.raises(ValueError, match="data-parallel replicas combined with attention"):
        resolve_dp_layout(2, 2, False, 2)
    hook = _strings("sglang/srt/arg_groups/parallel_hook.py")
    assert any("data-parallel replicas combined with attention data parallelism are not "
               "supported." in text for text in hook)  # (the tail of an f-string there)


def test_replicas_refuse_what_sglangs_asserts_refuse(model_dir):
    mixin = "sglang/srt/managers/tokenizer_control_mixin.py"
    for fn in ("init_weights_update_group", "destroy_weights_update_group",
               "update_weights_from_distributed", "update_weights_from_tensor"):
        asserts = [ast.unparse(n.test) for n in ast.walk(_function(mixin, fn))
                   if isinstance(n, ast.Assert)]
        assert "get_parallel().dp_size == 1" in asserts, fn
    disk = _function("sglang/srt/managers/tokenizer_manager.py", "update_weights_from_disk")
    assert not [n for n in ast.walk(disk) if isinstance(n, ast.Assert)]
    for handler in ("update_weights_from_tensor", "update_weights_from_distributed",
                    "init_weights_update_group"):  # nothing catches it: Starlette's plain 500
        assert not [n for n in ast.walk(_function(sglang_rules.HTTP_SERVER, handler))
                    if isinstance(n, ast.Try)], handler
    expected = _uncaught_assertion_answer()
    server = InProcessServer(model_dir, dp_size=2)
    try:
        info = http_json("GET", server.url + "/server_info")[1]
        assert (info["dp_size"], info["attn_dp_size"], info["enable_dp_attention"]) == (2, 1, False)
        for path, body in (
                ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
                ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
                ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                "rank_offset": 1, "world_size": 2}),
                ("/destroy_weights_update_group", {})):
            assert _raw_post(server.url + path, body) == expected, path
        status, answer = post(server, "/update_weights_from_disk", {
            "model_path": str(model_dir), "weight_version": "r2"})
        message = "Succeeded to update model weights."
        assert (status, answer) == (200, {  # two DP ranks answer, merged as 0.5.23 merges them
            "success": True, "message": f"{message} | {message} Weight version updated to r2.",
            "num_paused_requests": [0, 0]})
    finally:
        server.close()


def _raw_post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.headers.get("content-type"), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("content-type"), err.read()


def _uncaught_assertion_answer():
    """What FastAPI (under uvicorn, as SGLang runs it) answers for a handler whose assert fails."""
    import uvicorn
    from fastapi import FastAPI

    from pipeline.servers.cluster import free_port

    app = FastAPI()

    @app.post("/x")
    async def x():
        raise AssertionError("data-parallel replicas are not supported for update weights "
                             "from tensor")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 20)
        return _raw_post(f"http://127.0.0.1:{port}/x", {})
    finally:
        server.should_exit = True
        thread.join(10)
