"""Issue 38, item 9: the rollout client's connections are bounded, and running out of file
descriptors is said as such, never as "no live server".

The probe's run opened a connection pool per ``generate_groups`` call (one per group in an
asynchronous rollout, aiohttp's 100 connections each), reached ``Too many open files`` and
reported it as a dead server: the client asked the server pool to wait for a live server. Here
a client process with a lowered ``RLIMIT_NOFILE`` (a subprocess: the limit is per process) runs
40 groups of 4 samples at once, as the asynchronous rollout does, against a server that takes
0.2 s per request (in this process, aiohttp):

* with the limit a few dozen descriptors above what it holds, every sample is generated (one
  shared pool, a quarter of the limit by default: ``pipeline.generation.connections``);
* with no descriptor to spare, the run fails with ``TooManyOpenFiles`` naming EMFILE and the
  limits, at once, and the server pool is never asked to wait for a live server.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web

from pipeline.servers.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import asyncio, json, os, resource, sys
from pipeline.generation.client import RolloutClient, SamplingParams

class Pool:  # the run's ServerPool as the client sees it: no server comes back
    def __init__(self):
        self.waits, self.requests_retried = 0, 0
    def wait_for_live(self, error=None):
        self.waits += 1
        raise RuntimeError(f"rollout: no live server ({error})")

async def rollout(client):  # 40 groups at once, as rollout.async: full runs them
    return await asyncio.gather(*(client.generate_groups_async(
        [[5, 6, 7]], 4, SamplingParams(max_new_tokens=1), seed=g, rid_prefix=f"g{g}")
        for g in range(40)))

def attempt(url, spare):
    soft = len(os.listdir("/proc/self/fd")) + spare
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    pool = Pool()
    client = RolloutClient(server_urls=[url], servers=pool, request_timeout_s=30,
                           max_attempts=2, retry_backoff_s=0.05)
    try:
        groups = asyncio.run(rollout(client))
        return {"samples": sum(len(g[0]) for g in groups), "waits": pool.waits}
    except Exception as e:
        return {"error": type(e).__name__, "errno": getattr(e, "errno", None), "text": str(e),
                "waits": pool.waits}

url = sys.argv[1]
print(json.dumps({"bounded": attempt(url, 60), "exhausted": attempt(url, 4)}))
'''


@pytest.fixture(scope="module")
def slow_server():
    """A /generate that answers one token after 0.2 s (SGLang's body)."""
    async def generate(request):
        body = await request.json()
        await asyncio.sleep(0.2)
        return web.json_response({"text": "x", "output_ids": [2], "meta_info": {
            "id": body["rid"], "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(body["input_ids"]), "completion_tokens": 1,
            "weight_version": "0", "output_token_logprobs": [[-0.5, 2, None]]}})

    async def abort(request):
        return web.json_response(None)

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort)
    loop, runner, port = asyncio.new_event_loop(), web.AppRunner(app), free_port()
    started = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def test_bounded_connections_and_emfile_named_as_such(slow_server):
    proc = subprocess.run([sys.executable, "-c", CHILD, slow_server], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # 160 samples at once through a pool of a quarter of the limit: all of them generated
    assert out["bounded"] == {"samples": 160, "waits": 0}, out["bounded"]
    # nothing to spare: EMFILE, named, at once; the server pool never asked for a live server
    got = out["exhausted"]
    assert got["error"] == "TooManyOpenFiles" and got["waits"] == 0, got
    assert got["errno"] == 24 and "EMFILE: Too many open files" in got["text"], got
    assert "RLIMIT_NOFILE soft" in got["text"] and "not the server" in got["text"], got
    assert "no live server" not in got["text"], got
