"""The tool sandbox (``pipeline.tools.sandbox``): each way a tool can misbehave is one failed call with
its reason, and the next call on the same executor works.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_sandbox.py``
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pipeline.generation.environment import ToolEnvironment
from pipeline.generation.tool_calls import FORMATS
from pipeline.tools.sandbox import ToolExecutor, ToolLimits, ToolsInterrupted, load_tools

M = "tests.unit.sandbox_tools"
NAMES = ("add", "shout", "hang", "spin", "allocate", "flood_print", "flood_return", "exit_hard",
         "segfault", "fetch", "fetch_quietly", "raw_connect", "fail", "surrogate", "fail_surrogate")


@pytest.fixture(scope="module")
def executor():
    tools = load_tools([f"{M}:{n}" for n in NAMES])
    with ToolExecutor(tools, ToolLimits(timeout_s=2.0, memory_mb=64, output_bytes=2048),
                      workers=2) as ex:
        yield ex


def assert_works(ex: ToolExecutor) -> None:
    out = ex.call("add", {"a": 123456789, "b": 987654321})
    assert out.ok and out.output == "1111111110" and out.error is None


def test_a_call_returns_what_it_printed_then_its_value(executor):
    out = executor.call("shout", {"text": "hi"})
    assert out.ok and out.output == "printed: hi\nHI" and out.seconds > 0


@pytest.mark.parametrize("tool", ["hang", "spin"])
def test_a_call_past_its_timeout_is_killed_and_the_next_call_works(executor, tool):
    starts = executor.stats["worker_starts"]
    t0 = time.monotonic()
    out = executor.call(tool, {})
    assert not out.ok and out.error == "timeout" and "2 s" in out.output
    assert 1.9 < out.seconds < 5 and time.monotonic() - t0 < 6
    assert_works(executor)
    assert executor.stats["worker_starts"] > starts  # the killed worker was replaced


def test_the_trajectorys_tool_time_left_shortens_the_timeout(executor):
    out = executor.call("hang", {}, timeout_s=0.3)
    assert out.error == "timeout" and out.seconds < 1.5
    assert_works(executor)


def test_memory_past_the_limit_is_a_memory_error(executor):
    assert executor.call("allocate", {"mb": 8}).output == str(8 << 20)  # within the limit
    out = executor.call("allocate", {"mb": 512})
    assert not out.ok and out.error == "memory" and out.output.startswith("error: memory:")
    assert_works(executor)


@pytest.mark.parametrize("tool,args", [("flood_print", {}), ("flood_return", {"nbytes": 10**6})])
def test_an_output_flood_is_cut_at_the_limit(executor, tool, args):
    t0 = time.monotonic()
    out = executor.call(tool, args)
    assert not out.ok and out.error == "output_limit" and len(out.output) < 200
    assert time.monotonic() - t0 < 2.0  # stopped at the limit, not by the timeout
    assert executor.call("flood_return", {"nbytes": 2048}).ok  # exactly the limit is fine
    assert executor.call("flood_return", {"nbytes": 2049}).error == "output_limit"
    assert_works(executor)


@pytest.mark.parametrize("tool,how", [("exit_hard", "exited with status 3"),
                                      ("segfault", "killed by SIGSEGV")])
def test_a_crash_is_recorded_and_the_next_call_works(executor, tool, how):
    out = executor.call(tool, {})
    assert not out.ok and out.error == "crash" and how in out.output
    assert_works(executor)


@pytest.fixture
def listener():
    """A server on this machine's loopback that a tool could otherwise reach."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    accepted = []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            accepted.append(1)
            conn.sendall(b"secret")
            conn.close()
    stop = threading.Event()
    th = threading.Thread(target=serve, daemon=True)
    th.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    th.join()
    srv.close()


def test_network_attempts_fail_and_are_recorded(executor, listener):
    port, accepted = listener
    with socket.create_connection(("127.0.0.1", port)) as s:  # reachable from this process
        assert s.recv(6) == b"secret"
    accepted.clear()
    out = executor.call("fetch", {"port": port})
    assert not out.ok and out.error == "network"
    out = executor.call("fetch_quietly", {"port": port})  # caught by the tool: still reported
    assert not out.ok and out.error == "network"
    if executor.network_isolation == "namespace":  # below Python: no interface at all
        out = executor.call("raw_connect", {"port": port})
        assert not out.ok and out.error == "error" and "unreachable" in out.output
    else:
        pytest.fail("expected unprivileged network namespaces on the test machine "
                    f"(got {executor.network_isolation!r})")
    time.sleep(0.3)
    assert accepted == []  # nothing ever reached the server
    assert_works(executor)


def test_exceptions_unknown_tools_and_bad_arguments_are_errors(executor):
    out = executor.call("fail", {"message": "boom"})
    assert out.error == "error" and out.output == "error: error: ValueError: boom"
    out = executor.call("nope", {})
    assert out.error == "error" and "unknown tool 'nope'" in out.output and "add" in out.output
    out = executor.call("add", {"a": 1})
    assert out.error == "error" and "TypeError" in out.output
    assert_works(executor)


def test_calls_run_concurrently_on_the_workers(executor):
    warm = [threading.Thread(target=assert_works, args=(executor,)) for _ in range(2)]
    for t in warm:  # both workers started (a start is not what is timed below)
        t.start()
    for t in warm:
        t.join()
    results = []
    threads = [threading.Thread(target=lambda: results.append(executor.call("hang", {"seconds": 1})))
               for _ in range(2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.output for r in results] == ["woke up"] * 2
    assert time.monotonic() - t0 < 1.9  # both at once on the 2 workers


def test_output_that_is_not_utf8_text_is_a_failed_call_never_a_crash(executor):
    """Issue 38, item 5: a lone surrogate in what a tool returned (or raised) reached the
    tokenizer and ended the run with UnicodeEncodeError; it is a failed call (``encoding``), its
    text shown with U+FFFD."""
    out = executor.call("surrogate", {})
    assert not out.ok and out.error == "encoding"
    assert "not valid UTF-8" in out.output and "U+DCC3" in out.output
    assert "caf\ufffd ok" in out.output
    out.output.encode("utf-8")  # what is appended and tokenized
    out = executor.call("fail_surrogate", {})
    assert out.error == "error" and "bad byte \ufffd" in out.output
    out.output.encode("utf-8")
    env = ToolEnvironment(executor=executor, tool_format=FORMATS["qwen3"])
    step = env.step('<tool_call>{"name": "surrogate", "arguments": {}}</tool_call>',
                    tool_time_left_s=10)
    assert step.errors == ["encoding"] and not step.done
    step.observation.encode("utf-8")
    assert_works(executor)


def test_a_stop_signal_abandons_the_calls_running_and_waiting_at_once():
    """Issue 38, item 12: a stop during slow tool calls waited for each call's timeout (325 s
    with tools.timeout_s 20); with the stop flag the call running and the call waiting for the
    worker end within a poll, the worker killed."""
    stop = threading.Event()
    tools = load_tools([f"{M}:hang", f"{M}:add"])
    with ToolExecutor(tools, ToolLimits(timeout_s=30.0), workers=1,
                      interrupted=stop.is_set) as ex:
        assert ex.call("add", {"a": 1, "b": 2}).ok  # the worker started
        ended: dict[int, tuple[float, BaseException]] = {}

        def call(i: int) -> None:
            try:
                ex.call("hang", {})
            except BaseException as err:  # noqa: BLE001 - recorded for the assertion
                ended[i] = (time.monotonic(), err)
        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # one call runs, the other waits for the only worker
        t0 = time.monotonic()
        stop.set()
        for t in threads:
            t.join(timeout=10)
        assert sorted(ended) == [0, 1]
        assert all(isinstance(err, ToolsInterrupted) for _, err in ended.values())
        assert max(t for t, _ in ended.values()) - t0 < 1.0
        assert "a stop signal came" in str(ended[0][1])


def test_failures_are_counted_by_kind(executor):
    s = executor.stats
    assert s["calls"] > 10 and s["error/timeout"] >= 2 and s["error/crash"] >= 2
    assert s["error/memory"] >= 1 and s["error/output_limit"] >= 2 and s["error/network"] >= 2
    assert s["error/encoding"] >= 1


def test_bad_tool_specs_name_the_field():
    with pytest.raises(ValueError, match=r"tools.functions\[1\]: .*no attribute 'missing'"):
        load_tools([f"{M}:add", f"{M}:missing"])
    with pytest.raises(ValueError, match=r"tools.functions\[1\]: a second tool named 'add'"):
        load_tools([f"{M}:add", f"{M}:add"])
    with pytest.raises(ValueError, match=r"tools.functions\[0\]: 'nowhere.at_all:add': no module named 'nowhere'"):
        load_tools(["nowhere.at_all:add"])
    with pytest.raises(ValueError, match="tools.timeout_s"):
        ToolLimits(timeout_s=0)
