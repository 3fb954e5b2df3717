"""Issue 37, item 6: large ``/generate`` answers are read in the rollout client's parse process,
not in the training process's interpreter (``pipeline.generation.parse_pool``;
bench/bench_rollout_thread.py measures why), with the same samples and the same errors as when
read in the thread; small answers stay in the thread (no process for the CPU runs' short ones)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import os
import threading
import time

import numpy as np
import pytest

from pipeline.generation import parse_pool
from pipeline.generation.client import (RolloutClient, RolloutError, SamplingParams,
                                        parse_generate_text, read_generate_answer)

URL = "http://10.0.0.1:30000"
PROMPT = list(range(50))


def answer(tokens: int, *, routed: tuple[int, int] | None = None, bad_id: bool = False) -> bytes:
    rng = np.random.default_rng(tokens)
    ids = rng.integers(0, 151936, tokens).tolist()
    lps = (-rng.exponential(0.4, tokens)).astype(np.float32).astype(float).tolist()
    entries = [[lp, t + (1 if bad_id and i == tokens // 2 else 0), None]
               for i, (lp, t) in enumerate(zip(lps, ids))]
    meta = {"id": "r", "finish_reason": {"type": "length", "length": tokens}, "prompt_tokens": 50,
            "weight_version": "3", "output_token_logprobs": entries, "completion_tokens": tokens,
            "cached_tokens": 7, "weight_versions": [{"version": "2", "start": 0, "end": 5},
                                                    {"version": "3", "start": 5, "end": tokens}]}
    if routed is not None:
        rows = len(PROMPT) + tokens - 1
        experts = rng.integers(0, 128, rows * routed[0] * routed[1]).astype("<i4")
        meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode()
    return json.dumps({"text": "x" * tokens, "output_ids": ids, "meta_info": meta}).encode()


def _fields(r):
    d = {k: getattr(r, k) for k in ("rid", "prompt_ids", "output_ids", "output_logprobs",
                                    "finish_reason", "prompt_tokens", "completion_tokens",
                                    "weight_version", "weight_versions", "cached_tokens",
                                    "server_url")}
    d["routed"] = None if r.routed_experts is None else r.routed_experts.tolist()
    return d


@pytest.fixture(scope="module")
def pool():
    p = parse_pool.ParsePool()
    yield p
    p.close()


def test_a_large_answer_is_read_in_the_parse_process_and_gives_the_same_sample(pool):
    raw = answer(3000, routed=(2, 4))
    assert len(raw) >= parse_pool.MIN_BYTES
    before = pool.answers
    result = asyncio.run(read_generate_answer(raw, "r", PROMPT, URL, routed_experts=(2, 4),
                                              pool=pool))
    assert pool.answers == before + 1
    assert _fields(result) == _fields(parse_generate_text(raw, "r", PROMPT, URL,
                                                          routed_experts=(2, 4)))
    assert len(result.output_ids) == 3000 and isinstance(result.output_logprobs[0], float)
    # a small one stays in the thread
    small = answer(20)
    assert len(small) < parse_pool.MIN_BYTES
    asyncio.run(read_generate_answer(small, "s", PROMPT, URL, pool=pool))
    assert pool.answers == before + 1


def test_a_malformed_large_answer_is_the_same_error_as_in_the_thread(pool):
    raw = answer(3000, bad_id=True)
    with pytest.raises(RolloutError) as thread:
        parse_generate_text(raw, "r", PROMPT, URL)
    with pytest.raises(RolloutError) as process:
        asyncio.run(read_generate_answer(raw, "r", PROMPT, URL, pool=pool))
    assert str(process.value) == str(thread.value)
    assert "output_token_logprobs token ids differ from output_ids" in str(process.value)
    missing = answer(3000)  # asked for routed experts, the server did not return them
    with pytest.raises(RolloutError, match="asked for return_routed_experts"):
        asyncio.run(read_generate_answer(missing, "r", PROMPT, URL, routed_experts=(2, 4),
                                         pool=pool))


class _Server(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


def test_the_client_reads_large_answers_in_its_parse_process(monkeypatch, pool):
    """Through RolloutClient: the answers of a batch are parsed by another process."""
    monkeypatch.setattr(parse_pool, "_shared", pool)
    _Server.body = answer(3000)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = RolloutClient(server_urls=[f"http://127.0.0.1:{server.server_address[1]}"])
        before = pool.answers
        groups = client.generate_groups([PROMPT], 2, SamplingParams(max_new_tokens=3000), seed=1)
    finally:
        server.shutdown()
        server.server_close()
    assert pool.answers == before + 2
    assert [len(r.output_ids) for r in groups[0]] == [3000, 3000]
    workers = pool._executor._processes  # the parse process is another process than this one
    assert workers and os.getpid() not in workers


def test_the_parse_process_outlives_the_thread_that_first_used_it():
    """``rollout.async: one_step`` makes each rollout on a thread of its own: the first large
    answer started the parse process from that thread, and its parent-death signal (SIGKILL when
    the starting THREAD ends) killed it with the rollout; the next step's answers met a
    ``BrokenProcessPool``. Now it is started from a thread that lasts as long as the process."""
    pool = parse_pool.ParsePool()
    try:
        box = {}

        def first_rollout():
            box["answer"] = pool.submit(answer(2000), "r0", len(PROMPT)).result(timeout=120)
        rollout = threading.Thread(target=first_rollout)
        rollout.start()
        rollout.join(180)
        assert box["answer"].output_ids.shape == (2000,)
        time.sleep(1.0)  # the thread has ended: a parent-death signal would have fired by now
        again = pool.submit(answer(2000), "r1", len(PROMPT)).result(timeout=120)
        assert again.output_ids.shape == (2000,) and again.kind == "length"
    finally:
        pool.close()
