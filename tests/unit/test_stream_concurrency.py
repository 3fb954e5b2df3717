"""Issue 38, item 14: ``rollout.max_staleness`` and ``rollout.max_concurrency`` are bounded, and
``max_concurrency`` bounds the whole ``rollout.async: full`` stream, not each group.

``max_staleness: 100000`` passed ``config``; the stream then admitted (eta + 1) x P groups, each
with its own semaphore of max_concurrency, grew to 7.8 GB and ran out of file descriptors. Now
the config refuses it stating the samples, memory and requests it implies, and the stream's
requests in flight, counted by the server itself (the project's real ``RolloutClient``), never
exceed max_concurrency over all groups together.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.config.validate import MAX_STALENESS
from pipeline.generation.client import RolloutClient, SamplingParams
from pipeline.scoring.data import Prompt
from pipeline.sources.stream import RolloutStream


def test_max_staleness_is_bounded_stating_what_it_implies():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"rollout": {"async": "full", "max_staleness": 100000},
                          "run": {"global_batch_size": 16, "micro_batch_size": 4,
                                  "seq_length": 64}})
    message = str(err.value)
    assert message.startswith(f"rollout.max_staleness: 100000 is above {MAX_STALENESS}: "
                              "rollout.async full admits up to (eta + 1) x run.global_batch_size "
                              "= 1,600,016 samples ahead of the trainer, up to run.seq_length + 1 "
                              "= 65 tokens each: ~10.8 GiB on rank 0, and min(that, "
                              "rollout.max_concurrency 512) requests in flight"), message
    # routing replay's routes count too: 4 bytes x layers x top-k per token
    with pytest.raises(ConfigError, match=r"with their routed experts: ~"):
        config_from_dict({"rollout": {"max_staleness": MAX_STALENESS + 1},
                          "gspo": {"routing_replay": "rollout"}})
    assert config_from_dict({"rollout": {"async": "full", "max_staleness": MAX_STALENESS}})


@pytest.mark.parametrize("value", [0, -1, 8193, 100000])
def test_max_concurrency_is_bounded_naming_what_it_holds(value):
    with pytest.raises(ConfigError, match=rf"^rollout\.max_concurrency: must be in \[1, 8192\], "
                                          rf"got {value}: the requests rank 0 keeps in flight"):
        config_from_dict({"rollout": {"max_concurrency": value}})


class CountingServer:
    """A /generate server that holds each request ``hold_s`` and counts those it holds at once."""

    def __init__(self, hold_s: float = 0.05):
        self.lock = threading.Lock()
        self.now = self.peak = self.total = 0
        counter = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/generate":  # /abort_request when the stream closes
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with counter.lock:
                    counter.now += 1
                    counter.total += 1
                    counter.peak = max(counter.peak, counter.now)
                time.sleep(hold_s)
                with counter.lock:
                    counter.now -= 1
                body = json.dumps({"output_ids": [5, 6], "meta_info": {
                    "finish_reason": {"type": "stop", "matched": 6}, "weight_version": "0",
                    "output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]]}}).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a request the closing stream cancelled

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_max_concurrency_bounds_every_group_of_the_full_stream_together():
    eta, prompts_per_step, group_size, limit = 3, 4, 4, 6
    server = CountingServer()
    client = RolloutClient(server_urls=[server.url], max_concurrency=limit)
    drawn = []

    def draw() -> Prompt:
        drawn.append(len(drawn))
        return Prompt(index=drawn[-1], prompt_ids=[1, 2, 3], label=None, text="", origin="t")

    async def generate(prompt, seed, rid):
        groups = await client.generate_groups_async([prompt.prompt_ids], group_size,
                                                    SamplingParams(max_new_tokens=2), seed=seed,
                                                    rid_prefix=rid)
        return groups[0]

    stream = RolloutStream(generate=generate, score=lambda p, r: ([0.0] * len(r), 0), draw=draw,
                           prompts_per_step=prompts_per_step, max_staleness=eta, version=0,
                           taken=0, seed_of=lambda i, a: i, timeout_s=60.0)
    stream.start()
    try:
        for step in (1, 2):
            assert len(stream.take(step)) == prompts_per_step
            stream.set_version(step)
    finally:
        stream.close()
        server.close()
    # (eta + 1) x P = 16 groups of 4 requests were admitted at once: 64 could have run together
    assert stream.counts.admitted >= (eta + 1) * prompts_per_step
    assert server.total > limit
    assert server.peak == limit, f"{server.peak} requests in flight at once; the bound is {limit}"
