"""Issue 37 item 1: the local server answers ``/health`` as SGLang 0.5.23 does while paused.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_health_while_paused.py``

SGLang's rules (read from the wheel below): ``/health`` and ``/health_generate`` are one handler
that runs a one-token generation; a generation waits while the server is paused; the answer is
200 once anything comes back from the scheduler after the check began, 503 after
``SGLANG_HEALTH_CHECK_TIMEOUT`` (default 20 s); ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``
makes ``/health`` (only) answer 200 at once; ``/ready`` is 503 while paused. Each is checked
against one in-process server started with ``SGLANG_HEALTH_CHECK_TIMEOUT=1`` (``TIMEOUT_S``: a
failing check takes a second); the environment parsing is checked on its own.
"""

from __future__ import annotations

import ast
import concurrent.futures
import time

import pytest
import torch

from pipeline.generation.client import http_json
from pipeline.local import health_env
from tests.rollout.conftest import InProcessServer
from tests.sglang_wheel import read_member

TIMEOUT_S = 1
UPDATE_DELAY_S = 0.6


@pytest.fixture(scope="module")
def server(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as env:  # read once, when the server starts
        env.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(TIMEOUT_S))
        s = InProcessServer(model_dir, fault_update_delay_s=UPDATE_DELAY_S)
    assert s.server.state.health_check_timeout_s == TIMEOUT_S
    yield s
    s.close()
    torch.set_num_threads(threads)


@pytest.fixture
def paused(server):
    """The server paused (abort mode) for the test, resumed after it."""
    assert post(server, "/pause_generation", {"mode": "abort"})[0] == 200
    yield server
    post(server, "/continue_generation", {})
    server.server.state.health_generation = True


def post(server, path, body):
    return http_json("POST", server.url + path, body, timeout_s=60)


def timed_get(server, path) -> tuple[int, float]:
    t0 = time.monotonic()
    status, _ = http_json("GET", server.url + path, timeout_s=30)
    return status, time.monotonic() - t0


def test_unpaused_health_generates_and_answers_at_once(server):
    for path in ("/health", "/health_generate"):
        status, took = timed_get(server, path)
        assert status == 200 and took < 0.9 * TIMEOUT_S, (path, status, took)
    assert timed_get(server, "/ready")[0] == 200


def test_paused_health_waits_then_answers_503_and_ready_is_503(paused):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        checks = {path: pool.submit(timed_get, paused, path)
                  for path in ("/health", "/health_generate")}
    for path, check in checks.items():
        status, took = check.result()
        assert status == 503 and took >= TIMEOUT_S, (path, status, took)
    assert timed_get(paused, "/ready")[0] == 503  # paused, and unhealthy after a failed check
    post(paused, "/continue_generation", {})
    assert timed_get(paused, "/health")[0] == 200
    assert timed_get(paused, "/ready")[0] == 200  # a passing check makes it healthy again


def test_a_check_during_the_pause_answers_200_once_generation_continues(paused):
    paused.server.state.health_check_timeout_s = 20  # SGLang's default
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            check = pool.submit(timed_get, paused, "/health")
            time.sleep(0.3)
            assert not check.done()  # the generation waits for continue_generation
            post(paused, "/continue_generation", {})
            status, took = check.result(timeout=20)
    finally:
        paused.server.state.health_check_timeout_s = TIMEOUT_S
    assert status == 200 and 0.3 <= took < 5, (status, took)


def test_a_weight_update_during_the_pause_answers_a_waiting_check(paused, model_dir):
    """SGLang: any message from the scheduler (an update's answer too) ends a check with 200.
    The update holds the engine thread 0.6 s (--fault-update-delay-s): the check waits for
    it, past its own start, then passes, although generation stays paused."""
    paused.server.state.health_check_timeout_s = 5
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            update = pool.submit(post, paused, "/update_weights_from_disk",
                                 {"model_path": str(model_dir)})
            time.sleep(0.1)
            status, took = timed_get(paused, "/health")
            assert update.result(timeout=30)[0] == 200
    finally:
        paused.server.state.health_check_timeout_s = TIMEOUT_S
    assert status == 200 and took >= UPDATE_DELAY_S - 0.2, (status, took)
    assert paused.server.paused  # still paused: the update's answer is what passed the check


def test_generation_switch_off_makes_health_answer_while_paused(paused):
    paused.server.state.health_generation = False  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false
    status, took = timed_get(paused, "/health")
    assert status == 200 and took < 0.5, (status, took)
    status, took = timed_get(paused, "/health_generate")  # still a generation
    assert status == 503 and took >= TIMEOUT_S, (status, took)


def test_environment_is_read_as_sglang_reads_it():
    assert health_env.timeout_from_env({}) == 20
    assert health_env.timeout_from_env({"SGLANG_HEALTH_CHECK_TIMEOUT": "3"}) == 3
    with pytest.raises(ValueError, match="SGLANG_HEALTH_CHECK_TIMEOUT='2.5': not an integer"):
        health_env.timeout_from_env({"SGLANG_HEALTH_CHECK_TIMEOUT": "2.5"})
    on = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
    assert health_env.generation_from_env({}) is True
    for value, expected in (("false", False), ("0", False), ("No", False), ("n", False),
                            ("TRUE", True), ("1", True), ("yes", True), ("maybe", True)):
        assert health_env.generation_from_env({on: value}) is expected, value


def _function(member: str, name: str) -> ast.AST:
    tree = ast.parse(read_member(member).decode())
    return next(n for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def test_the_rules_are_sglangs():
    """What the server imitates, in SGLang 0.5.23's own code."""
    http = "sglang/srt/entrypoints/http_server.py"
    handler = _function(http, "health_generate")
    paths = {d.args[0].value for d in handler.decorator_list if isinstance(d, ast.Call)}
    assert paths == {"/health", "/health_generate"}
    source = ast.unparse(handler)
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get()" in source
    assert "request.url.path == '/health'" in source  # the switch spares /health only
    assert "input_ids=[0]" in source and "'max_new_tokens': 1" in source
    assert "last_receive_tstamp > tic" in source and "HEALTH_CHECK_TIMEOUT" in source
    text = read_member(http).decode()
    assert 'HEALTH_CHECK_TIMEOUT = int(os.getenv("SGLANG_HEALTH_CHECK_TIMEOUT", 20))' in text
    environ = read_member("sglang/srt/environ.py").decode()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in environ
    tm = "sglang/srt/managers/tokenizer_manager.py"
    generate = ast.unparse(_function(tm, "generate_request"))  # every generation waits if paused
    assert "await self.is_pause_cond.wait_for(lambda: not self.is_pause)" in generate
    manager = read_member(tm).decode()
    assert "return not self.is_pause and self.is_healthy()" in manager  # is_ready
    assert "self.last_receive_tstamp = real_time()" in ast.unparse(_function(tm, "handle_loop"))
    assert f'HEALTH_CHECK_RID_PREFIX = "{health_env.RID_PREFIX}"' in read_member(
        "sglang/srt/constants.py").decode()
