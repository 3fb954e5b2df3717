"""Rewards: built-ins, user functions, the HTTP service, and failures that name the sample."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from megatron_gspo.config import config_from_dict
from pipeline.scoring.data import Prompt
from pipeline.scoring.rewards import (FunctionReward, HTTPReward, RewardError, RewardSample, addition,
                              build_reward, compute_rewards, exact_match, load_function,
                              math_equal)
from pipeline.scoring.tasks import EOS_ID, encode


def _prompt(label, index=0, text="q"):
    return Prompt(index=index, prompt_ids=encode(text), label=label, text=text,
                  origin=f"train.jsonl:{index + 1}")


def _samples(responses, label="4", prompt_index=0):
    prompt = _prompt(label, prompt_index)
    return [RewardSample(prompt, i, encode(r), r) for i, r in enumerate(responses)]


def test_builtin_rewards():
    assert exact_match(_prompt(" 42 "), [], "42\n") == 1.0
    assert exact_match(_prompt("42"), [], "41") == 0.0
    p = _prompt("12", text="5+7=")
    assert addition(p, encode("12") + [EOS_ID] + encode("junk"), "") == 1.0
    assert addition(p, encode("13") + [EOS_ID], "") == 0.0
    with pytest.raises(RewardError, match=r"exact_match reward needs a label, and prompt 3 "
                                          r"\(train\.jsonl:4\) has none"):
        exact_match(_prompt(None, 3), [], "x")


def test_math_reward_through_math_verify():
    pytest.importorskip("math_verify", reason="the math reward needs math-verify")
    half = _prompt("1/2")
    assert math_equal(half, [], "So the answer is $\\boxed{\\frac{1}{2}}$.") == 1.0
    assert math_equal(half, [], "The answer is 0.5") == 1.0
    assert math_equal(half, [], "The answer is \\boxed{0.4}") == 0.0
    assert math_equal(half, [], "no idea") == 0.0
    assert math_equal(_prompt("\\frac{3}{4}"), [], "$0.75$") == 1.0
    assert math_equal(_prompt("42"), [], "it is 42") == 1.0
    # off the main thread math-verify's signal-based timeouts are switched off, not crashing
    out = []
    worker = threading.Thread(target=lambda: out.append(math_equal(half, [], "\\boxed{1/2}")))
    worker.start()
    worker.join()
    assert out == [1.0]


def test_failures_name_the_sample_or_count_as_zero():
    def reward(prompt, ids, text):
        if text == "boom":
            raise KeyError("no such thing")
        return {"ok": 1.0, "nan": math.nan, "inf": math.inf, "str": "1"}.get(text, 0.0)

    samples = _samples(["ok", "x", "nan"], prompt_index=5)
    with pytest.raises(RewardError, match=r"reward of prompt 5 \(train\.jsonl:6\), sample 2: "
                                          r"returned the non-finite reward nan"):
        compute_rewards(reward, samples)
    with pytest.raises(RewardError, match=r"prompt 5 .*sample 1: KeyError: 'no such thing'"):
        compute_rewards(reward, _samples(["ok", "boom"], prompt_index=5))
    with pytest.raises(RewardError, match=r"sample 0: returned str '1', expected a number"):
        compute_rewards(reward, _samples(["str"]))

    result = compute_rewards(reward, _samples(["ok", "boom", "inf", "x"], prompt_index=2),
                             on_error="zero")
    assert result.rewards == [1.0, 0.0, 0.0, 0.0]
    assert result.num_failures == 2
    assert [(f.prompt_index, f.sample_index) for f in result.failures] == [(2, 1), (2, 2)]
    assert "KeyError" in result.failures[0].error and "non-finite" in result.failures[1].error

    scalars = [np.float32(0.5), torch.tensor(0.25), True, 2]
    result = compute_rewards(lambda p, ids, t: scalars[int(t)], _samples(["0", "1", "2", "3"]))
    assert result.rewards == [0.5, 0.25, 1.0, 2.0] and result.failures == []


def test_user_function_by_module_or_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(prompt, response_ids, response_text):\n"
        "    return len(response_ids) / 10\n"
        "NOT_CALLABLE = 3\n")
    (tmp_path / "broken_rewards.py").write_text("import does_not_exist_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_function("my_rewards:length_bonus")
    assert fn(_prompt("x"), [1, 2, 3], "abc") == pytest.approx(0.3)
    assert load_function(f"{tmp_path / 'my_rewards.py'}:length_bonus")(_prompt("x"), [1], "") == 0.1
    with pytest.raises(RewardError, match=r"no module named 'nowhere_module'"):
        load_function("nowhere_module:f")
    with pytest.raises(RewardError, match=r"importing broken_rewards failed: No module named "
                                          r"'does_not_exist_anywhere'"):
        load_function("broken_rewards:f")
    with pytest.raises(RewardError, match=r"module my_rewards has no attribute 'nope' "
                                          r"\(it has: NOT_CALLABLE, length_bonus\)"):
        load_function("my_rewards:nope")
    with pytest.raises(RewardError, match="NOT_CALLABLE is a int, not callable"):
        load_function("my_rewards:NOT_CALLABLE")
    with pytest.raises(RewardError, match=r"expected \"module:function\""):
        load_function("my_rewards")
    with pytest.raises(RewardError, match="file .*missing.py not found"):
        load_function(f"{tmp_path / 'missing.py'}:f")


class _RewardService(BaseHTTPRequestHandler):
    """/ok: 1.0 where response == label; /flaky*: 503 on its first call; others misbehave."""

    calls: dict[str, int] = {}
    bodies: list = []

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        calls = type(self).calls
        calls[self.path] = calls.get(self.path, 0) + 1
        rewards = [1.0 if s["response"] == s["label"] else 0.0 for s in body]
        if self.path.startswith("/flaky") and calls[self.path] == 1:
            return self._send(503, b"warming up")
        if self.path == "/bad":
            return self._send(400, b"label missing")
        if self.path == "/short":
            rewards = rewards[:-1]
        if self.path == "/text":
            return self._send(200, b"<html>oops</html>")
        if self.path == "/slow":
            time.sleep(0.6)
        if self.path == "/nan":
            return self._send(200, b'{"rewards": [NaN]}')
        self._send(200, json.dumps({"rewards": rewards}).encode())

    def _send(self, code, payload):
        try:
            self.send_response(code)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # /slow: the client has given up
            pass


@pytest.fixture(scope="module")
def service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardService)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    with pytest.MonkeyPatch.context() as mp:  # urllib honours proxy variables, even for 127.0.0.1
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy",
                     "ALL_PROXY"):
            mp.delenv(name, raising=False)
        yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_reward_service(service):
    _RewardService.bodies.clear()
    fn = HTTPReward(f"{service}/ok", batch_size=2, timeout_s=5)
    samples = _samples(["4", "5", "4"], label="4", prompt_index=7)
    assert compute_rewards(fn, samples).rewards == [1.0, 0.0, 1.0]
    assert [len(b) for b in _RewardService.bodies] == [2, 1]  # batches of at most batch_size
    assert _RewardService.bodies[0][1] == {"prompt": "q", "response": "5", "label": "4",
                                           "prompt_index": 7, "sample_index": 1}
    assert fn(samples[0].prompt, [], "4") == 1.0

    flaky = HTTPReward(f"{service}/flaky", max_retries=1, backoff_s=0.01)
    assert compute_rewards(flaky, samples).rewards == [1.0, 0.0, 1.0]
    # without retries the first request fails: only its samples count as failures
    once = HTTPReward(f"{service}/flaky-once", max_retries=0, batch_size=2)
    result = compute_rewards(once, samples, on_error="zero")
    assert result.rewards == [0.0, 0.0, 1.0]
    assert [(f.prompt_index, f.sample_index) for f in result.failures] == [(7, 0), (7, 1)]
    assert "(request of 2 samples): HTTP 503: 'warming up'" in result.failures[0].error


@pytest.mark.parametrize("path, message", [
    ("/bad", r"reward of prompt 7 \(train\.jsonl:8\), sample 0: reward service "
             r"http://127\.0\.0\.1:\d+/bad \(request of 2 samples\): HTTP 400: 'label missing'"),
    ("/short", r"/short \(request of 2 samples\): sent 2 samples, got 1 rewards"),
    ("/text", r"/text \(request of 2 samples\): answered non-JSON '<html>oops</html>'"),
    ("/slow", r"/slow \(request of 2 samples\), after 2 attempts: no answer "
              r"\((TimeoutError|timeout)"),
])
def test_http_reward_errors_name_the_url_and_the_answer(service, path, message):
    timeout_s = 0.2 if path == "/slow" else 10.0  # the others must answer, however busy the host
    fn = HTTPReward(f"{service}{path}", timeout_s=timeout_s, max_retries=1, backoff_s=0.01)
    with pytest.raises(RewardError, match=message):
        compute_rewards(fn, _samples(["4", "5"], prompt_index=7))
    # on_error zero counts a failure as 0, but a call where every sample failed is an error too
    # (no reward at all to learn from), naming the service and the first sample's error
    with pytest.raises(RewardError, match=r"every one of the 2 rewards failed \(reward service "
                                          rf"http://127\.0\.0\.1:\d+{path};.*first: prompt 7 "):
        compute_rewards(fn, _samples(["4", "5"], prompt_index=7), on_error="zero")


def test_http_non_finite_and_unreachable(service):
    with pytest.raises(RewardError, match=r"prompt 0 .*sample 0: returned the non-finite reward nan"):
        compute_rewards(HTTPReward(f"{service}/nan"), _samples(["4"]))
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dead = HTTPReward(f"http://127.0.0.1:{port}/rewards", timeout_s=0.5, max_retries=0)
    with pytest.raises(RewardError, match=rf"reward service http://127\.0\.0\.1:{port}/rewards .*: "
                                          r"no answer \(ConnectionRefusedError"):
        compute_rewards(dead, _samples(["4"]))


def test_build_reward_from_config(service):
    assert build_reward(*_sections({})) is addition  # the task's own reward
    assert build_reward(*_sections({"reward": {"kind": "exact_match"}})) is exact_match
    fn = build_reward(*_sections({"reward": {"kind": "http", "url": f"{service}/ok",
                                             "timeout_s": 2.0}}))
    assert isinstance(fn, HTTPReward) and fn.timeout_s == 2.0
    fn = build_reward(*_sections({"reward": {"kind": "function",
                                             "function": "pipeline.scoring.rewards:exact_match"}}))
    # called in a worker process with reward.timeout_s per sample (test_reward_deadline.py)
    assert isinstance(fn, FunctionReward) and fn.function is exact_match and fn.timeout_s == 30.0


def _sections(data):
    cfg = config_from_dict(data)
    return cfg.reward, cfg.data
