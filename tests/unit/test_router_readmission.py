"""Issue 37 item 1: the client, the server pool and the pusher across a router that has not yet
re-admitted servers a weight sync paused (``pipeline.servers.readmission``).

Stand-ins over real HTTP (each a ``ThreadingHTTPServer`` in this process): a router that answers
``/generate`` with sglang-router 0.3.2's ``503 No available workers`` body (recorded from the
real router) while it lists its worker unhealthy, and a server whose ``/health`` fails (a paused
SGLang server's) while its ``/model_info`` answers. The real router and server: the extended
test tests/reliability/test_long_sync_pause.py.

* a request answered with that 503 while the pool says the server serves waits for the router,
  without spending attempts (the old client gave up after ``max_attempts``), bounded by
  ``readmit_timeout_s``, whose clock does not run while the sync pauses the servers;
* ``ServerPool.readmitted`` (after a sync) waits until the router lists every server healthy;
* the pool takes a server the sync paused for alive when ``/model_info`` answers;
* the pusher records the servers it paused until ``continue_generation`` answered.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipeline.generation import client
from pipeline.generation.client import (RolloutClient, RolloutError, SamplingParams,
                                        no_available_workers)
from pipeline.servers.pool import ServerPool
from pipeline.servers.readmission import RouterNotReadmitted
from pipeline.weights.push import WeightPusher, WeightPushError
from tests.reliability.loop_fakes import init_world_of_one

# sglang-router 0.3.2's answer when no worker is available (measured against the real router)
NO_WORKERS = json.dumps({"error": {"type": "Service Unavailable", "code": "no_available_workers",
                                   "message": "No available workers (all circuits open or "
                                              "unhealthy)"}})
SAMPLE = {"output_ids": [7], "meta_info": {"finish_reason": {"type": "length", "length": 1},
                                           "output_token_logprobs": [[-0.5, 7, None]]}}


class Fakes:
    """A router (``router_url``) in front of one server (``server_url``). ``healthy_after``: when
    (``time.monotonic()``) the router lists its worker healthy again (None: never);
    ``server_health``: the server's ``/health`` status (503: paused, as SGLang's after 20 s)."""

    def __init__(self):
        self.healthy_after = None
        self.server_health = 200
        self.generates = 0
        fakes = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def answer(self, status: int, body) -> None:
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.server is fakes.router:
                    self.answer(200, {"workers": [{"url": fakes.server_url,
                                                   "is_healthy": fakes.healthy()}]})
                elif self.path == "/health":
                    self.answer(fakes.server_health, "")
                else:  # /model_info: the HTTP process answers, paused or not
                    self.answer(200, {"weight_version": "0"})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                fakes.generates += 1
                if fakes.healthy():
                    self.answer(200, SAMPLE)
                else:
                    self.answer(503, NO_WORKERS)

        self.router = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.router_url = f"http://127.0.0.1:{self.router.server_address[1]}"
        self.server_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        for httpd in (self.router, self.server):
            threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                             daemon=True).start()

    def healthy(self) -> bool:
        return self.healthy_after is not None and time.monotonic() >= self.healthy_after

    def close(self):
        for httpd in (self.router, self.server):
            httpd.shutdown()
            httpd.server_close()


@pytest.fixture
def fakes():
    f = Fakes()
    yield f
    f.close()


def generate_one(fakes, pool) -> float:
    """One request through the router with a 2-attempt budget; its seconds."""
    pool.readmission.poll_s = 0.1
    c = RolloutClient(router_url=fakes.router_url, max_attempts=2, retry_backoff_s=0.01,
                      request_timeout_s=10)
    c.servers = pool
    t0 = time.monotonic()
    [[result]] = c.generate_groups([[5, 6]], 1, SamplingParams(max_new_tokens=1), seed=0)
    assert result.output_ids == [7]
    return time.monotonic() - t0


def test_the_routers_no_available_workers_answer_is_recognised():
    assert no_available_workers(503, NO_WORKERS)
    assert no_available_workers(503, "No available workers (all circuits open or unhealthy)")
    assert not no_available_workers(500, NO_WORKERS)
    assert not no_available_workers(503, json.dumps({"detail": "The request queue is full."}))
    assert not no_available_workers(503, "")


def test_a_request_waits_for_the_router_without_spending_its_attempts(fakes, capsys):
    pool = ServerPool([fakes.server_url], router_url=fakes.router_url, readmit_timeout_s=20)
    fakes.healthy_after = time.monotonic() + 1.2  # the router re-admits the server in 1.2 s
    took = generate_one(fakes, pool)
    assert took >= 1.1, took
    assert fakes.generates >= 2 and pool.readmission.request_waits == 1
    err = capsys.readouterr().err
    assert "answers 503 No available workers although its servers answer" in err, err
    assert "routes again after" in err and "rollout.router.readmit_timeout_s" in err, err


def test_a_router_that_never_routes_again_fails_after_the_bound(fakes):
    pool = ServerPool([fakes.server_url], router_url=fakes.router_url, readmit_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RolloutError) as err:
        generate_one(fakes, pool)
    assert isinstance(err.value, RouterNotReadmitted) and time.monotonic() - t0 >= 0.5
    text = str(err.value)
    assert "503 No available workers for 0.5 s (rollout.router.readmit_timeout_s)" in text, text
    assert f"{fakes.server_url} (unhealthy)" in text and \
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false" in text, text


def test_the_bound_starts_when_the_syncs_pause_ends(fakes):
    """Paused by the sync for 0.8 s, then re-admitted 0.5 s later: within a 0.7 s bound counted
    from the end of the pause, not from the first 503 (1.3 s before)."""
    pool = ServerPool([fakes.server_url], router_url=fakes.router_url, readmit_timeout_s=0.7)
    pool.paused.add([fakes.server_url])
    fakes.server_health = 503  # SGLang's /health while paused
    start = time.monotonic()
    fakes.healthy_after = start + 1.3

    def resume():
        time.sleep(0.8)
        fakes.server_health = 200
        pool.paused.discard([fakes.server_url])
    threading.Thread(target=resume, daemon=True).start()
    assert generate_one(fakes, pool) >= 1.2
    assert pool.members() == [fakes.server_url]  # never taken for dead while paused


def test_a_server_the_sync_paused_is_alive_while_its_http_process_answers(fakes):
    fakes.server_health = 503
    pool = ServerPool([fakes.server_url], min_servers=1)
    pool.paused.add([fakes.server_url])
    assert pool.check() == [fakes.server_url]
    pool.paused.discard([fakes.server_url])  # not paused by the sync: /health decides
    with pytest.raises(Exception, match="/health answered 503"):
        pool.check()


def test_after_a_sync_the_pool_waits_until_the_router_lists_every_live_server_healthy(fakes,
                                                                                     capsys):
    pool = ServerPool([fakes.server_url], router_url=fakes.router_url, readmit_timeout_s=10)
    pool.readmission.poll_s = 0.1
    fakes.healthy_after = time.monotonic()
    assert pool.readmitted() == 0.0 and capsys.readouterr().err == ""  # nothing to wait for
    fakes.healthy_after = time.monotonic() + 0.6
    waited = pool.readmitted()
    assert 0.5 <= waited < 5, waited
    err = capsys.readouterr().err
    assert f"marked {fakes.server_url} unhealthy during the pause" in err, err
    assert "routes to every server again after" in err, err
    fakes.healthy_after = None
    fakes.server_health = 503  # a server that died after the sync: not waited for
    assert pool.readmitted() == 0.0
    assert "does not answer: not waiting for the router" in capsys.readouterr().err
    fakes.server_health = 200
    pool.readmission.timeout_s = 0.4
    with pytest.raises(RouterNotReadmitted, match=r"still lists .* unhealthy .* after the weight "
                                                  r"sync resumed them \(rollout\.router\."
                                                  r"readmit_timeout_s 0\.4\)"):
        pool.readmitted()


class _Stream:
    """One float32 bucket on rank 0 (``WeightPusher.push``'s duck-typed stream)."""

    def __init__(self):
        flat = torch.arange(4, dtype=torch.float32).view(torch.uint8).clone()
        self.buckets = [SimpleNamespace(
            index=0, count=1, source=0, names=["w"], shapes=[(4,)], dtype=torch.float32,
            nbytes=flat.numel(), flat=flat, named_tensors=lambda: [("w", flat.view(torch.float32))])]
        self.meta, self.sources, self.num_tensors = self.buckets, [0], 1
        self.total_bytes, self.dtype = flat.numel(), torch.float32

    def __len__(self):
        return 1

    def __iter__(self):
        return iter(self.buckets)


@pytest.mark.parametrize("failing", ["", "/update_weights_from_tensor"])
def test_the_pusher_records_the_servers_it_paused_until_they_continue(monkeypatch, failing):
    url = "http://server-a"
    seen = []
    pusher = None

    def http_json(method, target, body=None, *, timeout_s, headers=None):
        path = target[len(url):]
        seen.append((path, url in pusher.paused))
        if path == failing:
            return 500, {"error": "boom"}
        return 200, ({"tp_size": 1, "dp_size": 1} if path == "/server_info" else
                     {"success": True})

    monkeypatch.setattr(client, "http_json", http_json)
    made = init_world_of_one()
    try:
        pusher = WeightPusher([url], transport="tensor", verify=False, timeout_s=5.0)
        try:
            pusher.push(_Stream(), version="1")
        except WeightPushError:
            assert failing
        finally:
            pusher.close()
    finally:
        if made:
            dist.destroy_process_group()
    states = dict(seen)
    assert states["/pause_generation"] and states["/update_weights_from_tensor"], seen
    assert seen[-1][0] == "/continue_generation" and not (url in pusher.paused), seen
