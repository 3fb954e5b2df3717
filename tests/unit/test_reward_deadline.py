"""Issue 22, item 1: a user reward function runs in a worker process with a deadline.

``reward.kind: function`` (``pipeline.scoring.rewards.FunctionReward``): a call that passes
``reward.timeout_s`` fails its sample with a RewardError naming the function, the sample and the
deadline (then ``reward.on_error`` decides), its worker is killed with what it started and a
fresh one scores the rest; a worker that dies fails its sample the same way; a stop signal
(``interrupted()``) abandons the call within a poll; the worker dies with its owner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigError, config_from_dict
from pipeline.scoring.data import Prompt
from pipeline.scoring.rewards import (FunctionReward, RewardError, RewardInterrupted, RewardSample,
                              build_reward, compute_rewards)

ROOT = Path(__file__).resolve().parents[2]

REWARDS = textwrap.dedent('''
    import os, subprocess, sys, time

    def correct(prompt, response_ids, response_text):
        return 1.0 if response_text == prompt.label else 0.0

    def hang_on_x(prompt, response_ids, response_text):
        if response_text == "x":
            time.sleep(3600)
        return 1.0

    def spawn_and_hang(prompt, response_ids, response_text):
        # a reward that starts a helper (a sandbox) and hangs: both must go
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        open(os.environ["PID_FILE"], "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(3600)

    def crash_on_x(prompt, response_ids, response_text):
        if response_text == "x":
            os._exit(3)
        return 0.5

    def spin(prompt, response_ids, response_text):
        while True:  # holds the GIL between bytecodes: a thread could not be abandoned cleanly
            pass

    def odd_values(prompt, response_ids, response_text):
        return {"a": "text", "b": float("nan")}.get(response_text, 2)

    def slow(prompt, response_ids, response_text):
        time.sleep(0.4)
        return 1.0

    def counter(prompt, response_ids, response_text, _state=[]):
        _state.append(os.getpid())
        return float(len(_state))
''')


@pytest.fixture
def rewards_file(tmp_path) -> Path:
    path = tmp_path / "user_rewards.py"
    path.write_text(REWARDS)
    return path


def _samples(texts, label="ok"):
    prompt = Prompt(index=0, prompt_ids=[1, 2], label=label, text="q", origin="train.jsonl:1")
    return [RewardSample(prompt, i, [ord(c) for c in t], t) for i, t in enumerate(texts)]


def _fn(rewards_file, name, timeout_s=2.0, **kw) -> FunctionReward:
    fn = FunctionReward(f"{rewards_file}:{name}", timeout_s=timeout_s, **kw)
    return fn


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_user_function_scores_in_a_worker_that_keeps_its_state(rewards_file):
    fn = _fn(rewards_file, "correct")
    try:
        result = compute_rewards(fn, _samples(["ok", "no", "ok"]))
        assert result.rewards == [1.0, 0.0, 1.0]
        assert fn(_samples(["ok"])[0].prompt, [], "ok") == 1.0
    finally:
        fn.close()
    counter = _fn(rewards_file, "counter")
    try:
        assert compute_rewards(counter, _samples(["a", "b"])).rewards == [1.0, 2.0]
        assert compute_rewards(counter, _samples(["c"])).rewards == [3.0]  # one worker, kept
        assert counter.worker_starts == 1
        assert counter._proc.pid != os.getpid()
    finally:
        counter.close()


def test_a_hanging_call_fails_its_sample_naming_the_function_and_the_deadline(rewards_file):
    fn = _fn(rewards_file, "hang_on_x", timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            compute_rewards(fn, _samples(["a", "x", "b"]))
        assert time.monotonic() - start < 20
        message = str(err.value)
        for fragment in ("hang_on_x", "reward.timeout_s = 1 s", "prompt 0 (train.jsonl:1), sample 1",
                         "killed"):
            assert fragment in message, (fragment, message)
        # on_error zero: the sample counts as 0, the others are scored by a fresh worker
        result = compute_rewards(fn, _samples(["a", "x", "b"]), on_error="zero")
        assert result.rewards == [1.0, 0.0, 1.0]
        assert [(f.sample_index, "did not return within reward.timeout_s" in f.error)
                for f in result.failures] == [(1, True)]
        assert fn.timeouts == 2
    finally:
        fn.close()


def test_a_timeout_kills_what_the_function_started(rewards_file, tmp_path, monkeypatch):
    pid_file = tmp_path / "pids"
    monkeypatch.setenv("PID_FILE", str(pid_file))
    fn = _fn(rewards_file, "spawn_and_hang", timeout_s=3.0)
    try:
        with pytest.raises(RewardError, match="did not return within"):
            compute_rewards(fn, _samples(["a"]))
        worker, child = map(int, pid_file.read_text().split())
        deadline = time.monotonic() + 10
        while (_alive(worker) or _alive(child)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker) and not _alive(child), (worker, child)
    finally:
        fn.close()


def test_a_function_that_holds_the_gil_is_still_bounded(rewards_file):
    fn = _fn(rewards_file, "spin", timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"spin did not return within reward\.timeout_s = 1 s"):
            compute_rewards(fn, _samples(["a"]))
        assert time.monotonic() - start < 20
    finally:
        fn.close()


def test_a_worker_that_dies_fails_its_sample_and_a_new_one_scores_the_rest(rewards_file):
    fn = _fn(rewards_file, "crash_on_x")
    try:
        result = compute_rewards(fn, _samples(["a", "x", "b"]), on_error="zero")
        assert result.rewards == [0.5, 0.0, 0.5]
        assert len(result.failures) == 1 and "exit status 3" in result.failures[0].error
        assert "crash_on_x ended its worker process" in result.failures[0].error
        assert fn.worker_starts == 2
    finally:
        fn.close()


def test_values_and_errors_read_as_in_process(rewards_file):
    fn = _fn(rewards_file, "odd_values")
    try:
        result = compute_rewards(fn, _samples(["a", "b", "c"]), on_error="zero")
        assert result.rewards == [0.0, 0.0, 2.0]
        assert [f.error for f in result.failures] == [
            "returned str 'text', expected a number", "returned the non-finite reward nan"]
    finally:
        fn.close()


def test_a_stop_signal_abandons_the_call_at_once(rewards_file):
    stop_at = time.monotonic() + 1.0
    fn = _fn(rewards_file, "hang_on_x", timeout_s=600.0,
             interrupted=lambda: time.monotonic() > stop_at)
    try:
        with pytest.raises(RewardInterrupted, match="a stop signal came while reward function"):
            compute_rewards(fn, _samples(["x"]), on_error="zero")  # not counted as a failure
        assert time.monotonic() - stop_at < 5
        assert fn._proc is None  # killed
    finally:
        fn.close()


def test_build_reward_runs_a_user_function_with_the_configured_deadline(rewards_file):
    cfg = config_from_dict({"reward": {"kind": "function", "function": f"{rewards_file}:correct",
                                       "timeout_s": 7.5}})
    fn = build_reward(cfg.reward, cfg.data)
    assert isinstance(fn, FunctionReward) and fn.timeout_s == 7.5
    assert fn.function.__name__ == "correct"
    with pytest.raises(ConfigError, match=r"reward\.timeout_s: must be > 0"):
        config_from_dict({"reward": {"timeout_s": 0}})
    with pytest.raises(ConfigError, match=r"reward\.timeout_s"):
        config_from_dict({"reward": {"timeout_s": float("inf")}})


def test_the_worker_dies_with_its_owner_even_by_sigkill(rewards_file, tmp_path):
    """An owner killed by SIGKILL (no atexit) takes its worker along (PR_SET_PDEATHSIG)."""
    pid_file = tmp_path / "worker.pid"
    owner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f'''
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from pipeline.scoring.rewards import FunctionReward, RewardSample
        from pipeline.scoring.data import Prompt
        fn = FunctionReward({f"{rewards_file}:correct"!r}, timeout_s=5)
        fn.score_batch([RewardSample(Prompt(0, [1], "ok", "q", "t:1"), 0, [1], "ok")])
        open({str(pid_file)!r}, "w").write(str(fn._proc.pid))
        time.sleep(3600)
    ''')], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert owner.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        assert _alive(worker)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker)
    finally:
        owner.kill()


def test_a_worker_started_by_a_rollout_thread_outlives_the_thread(rewards_file):
    """rollout.async runs each rollout on a thread of its own: PR_SET_PDEATHSIG fires when the
    thread that started a child ends, so the worker is started from one long-lived thread."""
    import threading

    fn = _fn(rewards_file, "counter")
    try:
        out = []
        thread = threading.Thread(target=lambda: out.append(
            compute_rewards(fn, _samples(["a"])).rewards))
        thread.start()
        thread.join()
        assert out == [[1.0]]
        worker = fn._proc.pid
        time.sleep(1.0)
        assert _alive(worker)  # not killed when the thread ended
        assert compute_rewards(fn, _samples(["b"])).rewards == [2.0]  # same worker, its state
        assert fn.worker_starts == 1
    finally:
        fn.close()


def test_a_steps_rewards_are_bounded_as_a_whole_and_said_on_the_console(rewards_file):
    """Issue 38, item 13: every sample within its own deadline, but many of them: the step's
    bound (``reward.step_timeout_s``) ends the scoring, the samples left fail naming it, and
    the console says so when it happens (not after samples x timeout_s)."""
    said = []
    fn = _fn(rewards_file, "slow", timeout_s=1.0, step_timeout_s=1.0, say=said.append)
    try:
        start = time.monotonic()
        result = compute_rewards(fn, _samples(["a"] * 20), on_error="zero")
        took = time.monotonic() - start
        assert took < 5, took  # without the bound: 20 x 0.4 s
        scored = [r for r in result.rewards if r == 1.0]
        assert len(scored) <= 3 and len(result.failures) == 20 - len(scored)
        assert all("reward.step_timeout_s = 1 s" in f.error for f in result.failures)
        assert len(said) == 1 and said[0].startswith("reward: ") and "step_timeout_s" in said[0]
        assert f"{len(scored)} of 20 samples scored" in said[0]
    finally:
        fn.close()


def test_with_on_error_raise_the_first_hang_ends_the_steps_scoring(rewards_file):
    """``reward.on_error: raise``: the run stops at the first sample past its deadline; the
    samples after it are not waited for (each would hang its own timeout_s)."""
    said = []
    fn = _fn(rewards_file, "hang_on_x", timeout_s=0.5, fail_fast=True, say=said.append)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            compute_rewards(fn, _samples(["x"] * 8))
        took = time.monotonic() - start
        assert took < 4, took  # without fail_fast: 8 x 0.5 s and a worker start each
        assert "reward.timeout_s = 0.5 s" in str(err.value) and "sample 0" in str(err.value)
        assert len(said) == 1 and "did not return within reward.timeout_s" in said[0]
        assert fn.worker_starts == 1
    finally:
        fn.close()


def test_the_step_bound_is_checked_against_the_sample_deadline():
    base = {"reward": {"kind": "function", "function": "m:f", "timeout_s": 30}}
    with pytest.raises(ConfigError, match=r"reward.step_timeout_s: must be >= reward.timeout_s"):
        config_from_dict({**base, "reward": {**base["reward"], "step_timeout_s": 10}})
    assert config_from_dict(base).reward.step_timeout_s == 600.0
