"""Issue 11, items 9 and 10: the local rollout server's request limits and weight endpoints.

The real server (``pipeline.local.server``, uvicorn in this process) on a tiny Qwen3-MoE:

* item 9: ``n`` above ``--max-n`` is a 400 with SGLang's ValueError body (the probe's
  ``n: 1000000`` OOM-killed a server in 14 s), and a request that does not fit in
  ``--max-queued-requests`` gets SGLang's own answer, 503 ``{"detail": "The request queue is
  full."}`` (``Scheduler._abort_on_queued_limit`` in the 0.5.23 wheel);
* item 10: every malformed ``update_weights_from_disk`` - a shard cut inside its header or its
  data, an index that is not JSON, has no ``weight_map`` or a wrong one - is a 400
  ``{"success": false, "message": <why>}`` (the probe got HTTP 500) that leaves every weight as
  it was; a directory outside the model's and ``--weight-roots``, or an index entry with
  ``../`` or a symlink out of them, is refused; ``init_weights_update_group`` never makes the
  server host a store (the probe: rank_offset 0 opened one on all interfaces for 300 s) and the
  trainer's store listens on the group's address only; no ``torch.load(weights_only=False)``.

Issue 22, item 10 (a 64 MiB ``/generate`` cost the probe's server ~860 MiB before its 400, and
deeply nested JSON was a 500):

* a body over ``--max-request-mb`` is a 413 decided from its ``Content-Length`` before a byte of
  it is read, and a chunked one as soon as the bytes received pass the limit;
  ``update_weights_from_tensor`` / ``_distributed`` (base64 weight buckets) have their own,
  larger ``--max-weight-update-mb``;
* JSON nested deeper than ``--max-json-depth`` is a 400 (SGLang's HTTPException body), checked
  on the bytes before parsing; brackets inside strings do not count.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.weights import transport as wt
from pipeline.generation.client import http_json
from pipeline.servers.cluster import free_port
from tests.rollout.conftest import InProcessServer
from tests.rollout.tiny import make_model_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("limits")
    model = make_model_dir(base / "model")
    roots = base / "weights"  # the --weight-roots directory
    roots.mkdir()
    outside = base / "elsewhere"
    outside.mkdir()
    return {"model": model, "root": roots, "outside": outside}


@pytest.fixture(scope="module")
def server(dirs):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    srv = InProcessServer(dirs["model"], max_running_requests=1, max_queued_requests=8,
                          max_n=8, weight_roots=[str(dirs["root"])], weight_update_timeout=4.0,
                          max_request_mb=1, max_weight_update_mb=4)
    yield srv
    srv.close()
    torch.set_num_threads(threads)


def post(server, path, body, timeout_s=60.0):
    return http_json("POST", server.url + path, body, timeout_s=timeout_s)


def checksum(server) -> str:
    return post(server, "/weights_checker", {"action": "checksum"})[1]["checksum"]


# ------------------------------------------------------------------------------------------------
# item 9: /generate limits


def test_n_above_max_n_is_a_400_at_once(server):
    start = time.monotonic()
    status, answer = post(server, "/generate", {"input_ids": [5, 6], "sampling_params": {
        "n": 1_000_000, "max_new_tokens": 1}}, timeout_s=20)
    assert status == 400, (status, str(answer)[:300])
    assert set(answer) == {"error"} and "--max-n 8" in answer["error"]["message"], answer
    assert time.monotonic() - start < 5
    status, _ = post(server, "/generate", {"input_ids": [5, 6], "sampling_params": {
        "n": 8, "max_new_tokens": 1}})
    assert status == 200  # at the limit: served
    assert http_json("GET", server.url + "/health")[0] == 200


def test_a_request_that_does_not_fit_the_queue_is_sglangs_503(server):
    # nine prompts, one sample each, 8 places in the queue: refused before anything is queued
    status, answer = post(server, "/generate", {"input_ids": [[t] for t in range(5, 14)],
                                                "sampling_params": {"max_new_tokens": 1}})
    assert (status, answer) == (503, {"detail": "The request queue is full."})
    # a long request fills the queue (1 running, 7 waiting); the next 2 samples do not fit
    long = {}
    thread = threading.Thread(target=lambda: long.update(answer=post(server, "/generate", {
        "input_ids": [5], "sampling_params": {"n": 8, "max_new_tokens": 200,
                                              "ignore_eos": True}})))
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while http_json("GET", server.url + "/v1/loads")[1]["loads"][0]["num_waiting_reqs"] < 7:
            assert time.monotonic() < deadline, "the long request never queued"
            time.sleep(0.01)
        status, answer = post(server, "/generate", {"input_ids": [6], "sampling_params": {
            "n": 2, "max_new_tokens": 1}})
        assert (status, answer) == (503, {"detail": "The request queue is full."})
    finally:
        post(server, "/abort_request", {"abort_all": True})
        thread.join(60)
    assert long["answer"][0] == 200
    status, _ = post(server, "/generate", {"input_ids": [6], "sampling_params": {
        "n": 2, "max_new_tokens": 1}})
    assert status == 200  # room again


# ------------------------------------------------------------------------------------------------
# item 10: weight updates


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(server, path, *words) -> str:
    before = checksum(server)
    status, answer = post(server, "/update_weights_from_disk", {"model_path": str(path)})
    assert status == 400 and isinstance(answer, dict) and answer["success"] is False, \
        (status, str(answer)[:500])
    for word in words:
        assert word in answer["message"], (word, answer["message"])
    assert checksum(server) == before  # nothing changed
    return answer["message"]


def test_truncated_shards_are_refused_and_change_nothing(server, dirs, tmp_path):
    root = dirs["root"]
    cut_data = _copy_model(dirs["model"], root / "cut_data")
    shard = cut_data / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    _refused(server, cut_data, "model.safetensors", "truncated")
    cut_header = _copy_model(dirs["model"], root / "cut_header")
    shard = cut_header / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:5])
    _refused(server, cut_header, "model.safetensors", "truncated")
    garbage = _copy_model(dirs["model"], root / "garbage")
    raw = bytearray((garbage / "model.safetensors").read_bytes())
    raw[8:40] = b"\xff" * 32  # inside the JSON header
    (garbage / "model.safetensors").write_bytes(bytes(raw))
    _refused(server, garbage, "malformed safetensors header")
    status, answer = post(server, "/update_weights_from_disk", {"model_path": str(dirs["model"])})
    assert status == 200 and answer["success"] is True  # the intact model still loads


@pytest.mark.parametrize("index, words", [
    ("{not json", ["malformed index", "JSONDecodeError"]),
    ('{"metadata": {}}', ["malformed index", "weight_map"]),
    ('{"weight_map": ["model.safetensors"]}', ["'weight_map' must be"]),
    ('{"weight_map": {"lm_head.weight": 7}}', ["not a file name"]),
    ('{"weight_map": {"lm_head.weight": "missing.safetensors"}}', ["no such file"]),
], ids=["not-json", "no-weight-map", "list", "not-a-name", "missing-file"])
def test_malformed_index_is_a_success_false_answer(server, dirs, index, words):
    target = dirs["root"] / f"index_{abs(hash(index))}"
    _copy_model(dirs["model"], target)
    (target / "model.safetensors.index.json").write_text(index)
    _refused(server, target, "model.safetensors.index.json", *words)


def test_weight_paths_are_confined_to_the_roots(server, dirs):
    outside = _copy_model(dirs["model"], dirs["outside"] / "model_copy")
    _refused(server, outside, "outside the directories", "--weight-roots")
    _refused(server, dirs["root"] / ".." / "elsewhere" / "model_copy", "outside the directories")
    # an index inside a root that points out of it: ../ and a symlink
    escape = dirs["root"] / "escape"
    escape.mkdir()
    (escape / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "../../elsewhere/model_copy/model.safetensors"}}))
    _refused(server, escape, "not a file name")
    link = dirs["root"] / "link"
    link.mkdir()
    (link / "model.safetensors").symlink_to(outside / "model.safetensors")
    _refused(server, link, "outside the directories")
    _refused(server, "/etc", "outside the directories")


def _listening(port: int) -> list[str]:
    """Local addresses listening on TCP ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.append("any" if set(address) == {"0"} else address)
    return found


def test_init_weights_update_group_never_makes_the_server_host_a_store(server):
    port = free_port()
    seen: list[str] = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.extend(_listening(port))
            time.sleep(0.02)
    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    try:
        status, answer = post(server, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 0,
            "world_size": 2, "group_name": "probe", "backend": "gloo"}, timeout_s=30)
    finally:
        done.set()
        watcher.join()
    assert status == 400 and answer["success"] is False and "rank_offset 0" in answer["message"]
    assert time.monotonic() - start < 3  # refused, not a store waiting 300 s
    assert seen == [], seen  # no listening socket at all, on any interface


def _group_member(port: int, queue) -> None:
    """Rank 1 of the group, made the tcp:// rendezvous way (as a server joins), in a process of
    its own: receives one broadcast."""
    import torch.distributed as dist

    g = wt.new_update_group("127.0.0.1", port, 1, 2, group_name="bound", timeout_s=60)
    t = torch.zeros(4)
    dist.broadcast(t, src=0, group=g)
    queue.put(t.tolist())
    wt.destroy_group(g)


def test_trainers_update_group_store_listens_on_the_group_address_only():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port, queue = wt.free_port("127.0.0.1"), ctx.Queue()
    member = ctx.Process(target=_group_member, args=(port, queue))
    member.start()
    try:
        group = wt.new_update_group("127.0.0.1", port, 0, 2, group_name="bound", timeout_s=60)
        addresses = _listening(port)
        wt.broadcast(group, torch.arange(4.0), 0)
        assert queue.get(timeout=60) == [0.0, 1.0, 2.0, 3.0]
        wt.destroy_group(group)
    finally:
        member.join(30)
        if member.is_alive():
            member.kill()
    loopback = socket.inet_aton("127.0.0.1")[::-1].hex().upper()  # /proc's byte order
    assert addresses == [loopback], addresses  # not "any" (0.0.0.0 / ::)


def test_no_torch_load_with_weights_only_false_anywhere():
    pattern = re.compile(r"weights_only\s*=\s*False")
    hits = []
    for folder in ("megatron_gspo", "pipeline", "launch", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.resolve() == Path(__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert hits == [], hits


# ------------------------------------------------------------------------------------------------
# issue 22, item 10: body size and JSON depth


def _raw_request(server, path: str, headers: dict, chunks=(), timeout_s: float = 10.0):
    """Send a request head and then ``chunks`` (bytes, already framed) until the server answers;
    returns (status, parsed body, bytes of ``chunks`` sent before the answer came)."""
    import select

    port = int(server.url.rsplit(":", 1)[1])
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    sent = 0
    try:
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # answered: stop sending
            try:
                sock.sendall(chunk)
            except OSError:  # the server closed the connection after its answer
                break
            sent += len(chunk)
        raw = b""
        deadline = time.monotonic() + timeout_s
        while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < int(
                re.search(rb"content-length: (\d+)", raw.lower()).group(1)):
            assert time.monotonic() < deadline, raw[:300]
            part = sock.recv(65536)
            if not part:
                break
            raw += part
    finally:
        sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), sent


def test_a_body_over_the_limit_is_a_413_from_its_content_length(server):
    start = time.monotonic()
    status, answer, _ = _raw_request(server, "/generate", {"Content-Length": 64 << 20},
                                     [b'{"input_ids": ['])  # 64 MiB announced, 15 bytes sent
    assert status == 413, answer
    assert answer["code"] == 413 and answer["object"] == "error", answer
    assert "--max-request-mb 1" in answer["message"] and str(64 << 20) in answer["message"]
    assert time.monotonic() - start < 5  # answered without waiting for the body
    assert http_json("GET", server.url + "/health")[0] == 200


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(server):
    piece = b"5," * (32 << 10)  # 64 KiB of a JSON array of ints
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    chunks = [frame] * 1024  # 64 MiB if it were all sent
    status, answer, sent = _raw_request(server, "/generate", {"Transfer-Encoding": "chunked"},
                                        [f"{15:x}\r\n".encode() + b'{"input_ids": [' + b"\r\n",
                                         *chunks])
    assert status == 413 and "--max-request-mb 1" in answer["message"], answer
    assert sent < 24 << 20, sent  # stopped long before the 64 MiB (socket buffers aside)
    assert http_json("GET", server.url + "/health")[0] == 200


def test_weight_update_paths_have_their_own_larger_limit(server):
    big = {"serialized_named_tensors": ["A" * (2 << 20)], "flush_cache": False}
    status, answer = post(server, "/update_weights_from_tensor", big)  # 2 MiB: read, answered
    assert status == 400 and answer["success"] is False, (status, str(answer)[:300])
    assert "begin_weight_update" in answer["message"]  # refused for the session, not the size
    # the same 2 MiB to /generate is refused from its Content-Length, before it is read (sent
    # raw: a client still writing when the server closes may see a broken pipe, not the 413)
    body = json.dumps({"input_ids": [5], "padding": "A" * (2 << 20)}).encode()
    pieces = [body[i:i + (64 << 10)] for i in range(0, len(body), 64 << 10)]
    status, answer, _ = _raw_request(server, "/generate", {"Content-Length": len(body)}, pieces)
    assert status == 413 and "--max-request-mb 1" in answer["message"], (status, answer)
    status, answer, _ = _raw_request(server, "/update_weights_from_tensor",
                                     {"Content-Length": 5 << 20}, [b"{"])
    assert status == 413 and "--max-weight-update-mb 4" in answer["message"], answer


def test_deeply_nested_json_is_a_400_not_a_500(server):
    deep = '{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for path in ("/generate", "/update_weights_from_tensor", "/pause_generation"):
        status, answer, _ = _raw_request(server, path, {"Content-Length": len(deep)},
                                         [deep.encode()])
        assert status == 400, (path, status, answer)
        assert answer["code"] == 400 and "--max-json-depth 64" in answer["message"], answer
    just_over = '{"input_ids": [5], "x": ' + "[" * 64 + "]" * 64 + "}"  # depth 65
    status, answer = post(server, "/generate", json.loads(just_over))
    assert status == 400 and "--max-json-depth 64" in answer["message"], answer
    # at the limit, and brackets in strings (with and without escapes) do not count: served
    for extra in ("[" * 62 + "]" * 62, json.dumps("[{" * 500), json.dumps('\\"[' * 500)):
        body = '{"input_ids": [5], "sampling_params": {"max_new_tokens": 1}, "x": ' + extra + "}"
        status, answer, _ = _raw_request(server, "/generate", {"Content-Length": len(body)},
                                         [body.encode()], timeout_s=60)
        assert status == 200, (extra[:20], status, answer)


def test_the_refusals_use_sglangs_httpexception_body():
    """SGLang 0.5.23 answers an HTTPException (FastAPI's 400 for a body its parser gives up on,
    e.g. nested past the recursion limit) with ``ErrorResponse(message=detail,
    type=str(status), code=status)``: the 413 and the depth 400 use that shape."""
    import inspect

    import fastapi.routing

    from pipeline.local.protocol import http_error_body
    from tests.sglang_wheel import read_member

    src = read_member("sglang/srt/entrypoints/http_server.py").decode()
    handler = src[src.index("@app.exception_handler(HTTPException)"):]
    handler = handler[handler.index("    error = ErrorResponse("):]
    handler = handler[:handler.index("return ORJSONResponse")]
    for part in ('object="error"', "message=exc.detail", "type=str(exc.status_code)",
                 "code=exc.status_code"):
        assert part in handler, (part, handler)
    protocol = read_member("sglang/srt/entrypoints/openai/protocol.py").decode()
    fields = protocol[protocol.index("class ErrorResponse(BaseModel):"):].split("\n\n")[0]
    names = {line.split(":")[0].strip() for line in fields.splitlines()[1:] if ":" in line}
    assert names == set(http_error_body(413, "m")) == {"object", "message", "type", "param", "code"}
    assert http_error_body(413, "m")["type"] == "413"
    assert "There was an error parsing the body" in inspect.getsource(fastapi.routing)
