"""The rollout producer of ``rollout.async: one_step`` / ``full`` in its own process (issue 37, item
6): ``pipeline.sources.remote.RemoteSource`` and a real ``python -m pipeline.producer.worker``.

* it makes exactly the batches (routed experts included), metrics and checkpoint state the
  in-process source (the rollout thread) makes, in another process; a checkpoint's batch resumes through a new producer; a
  stop signal that reaches it (SIGTERM, SIGINT, SIGUSR1, SIGHUP: a job-wide stop) changes
  nothing;
* ``full``: the stream runs there (batches, metrics, the stream's state);
* an error in it (a server refusing the request) reaches rank 0 as the error it raised, naming
  the server, at once; its death while rank 0 waits as one line naming its exit, not a hang;
* a stop signal on rank 0 reaches it: a reward call in flight is abandoned;
* it never outlives rank 0: SIGKILL of the process that started it ends it within seconds.

The server is a scripted ``/generate`` endpoint answering in SGLang 0.5.23's format
(``pipeline.local.bodies.render_json``), deterministic in the request's seed and prompt, on a
thread of the test (what crosses the process boundary is under test; the real servers and the
router in async runs: tests/e2e/test_async_one_step.py, test_async_full.py,
tests/reliability/test_dead_server.py, test_long_sync_pause.py).

Run: ``.venv/bin/python -m pytest -q tests/reliability/test_producer_process.py`` (~25 s: each
test starts a producer, ~3 s of imports on the 2-core machine)
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.lifetime import STOP_SIGNALS
from pipeline.context import LoopContext
from pipeline.generation.client import RolloutError
from pipeline.engines.factory import ClientSpec, build_client
from pipeline.generation.routed_experts import encode, expected_rows
from pipeline.local.bodies import render_json
from pipeline.observe.metrics import MetricsLogger
from pipeline.scoring.data import PromptSampler, TaskPromptDataset
from pipeline.scoring.rewards import RewardInterrupted, build_reward
from pipeline.scoring.tasks import AdditionTask
from pipeline.signals import StopFlag
from pipeline.sources.base import BUFFER_KEY, STREAM_KEY
from pipeline.sources.choice import make_source
from pipeline.sources.one_step import OneStepSource
from pipeline.sources.remote import ProducerGone, RemoteSource
from pipeline.sources.stream import StreamSource

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = {"rollout_s", "rollout_tokens_per_s", "trainer_wait_rollout_s"}


class ScriptedServer:
    """``/generate`` in SGLang's format: 3-6 digit tokens drawn from the request's sampling seed
    and prompt; ``reject``: 400 with SGLang's error body; ``delay_s`` before each answer."""

    def __init__(self):
        self.version, self.reject, self.delay_s = 0, False, 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/generate":
                    status, answer = server.answer(body)
                else:  # /abort_request and the like
                    status, answer = 200, {}
                raw = render_json(answer)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> tuple[int, dict]:
        time.sleep(self.delay_s)
        if self.reject:
            return 400, {"error": {"message": "The input (40 tokens) is longer than the model's "
                                              "context length (32 tokens).", "code": 400}}
        ids, seed = body["input_ids"], body["sampling_params"]["sampling_seed"]
        rng = random.Random(seed * 1_000_003 + sum(ids))
        n = rng.randint(3, 6)
        out = [rng.randint(48, 57) for _ in range(n)]
        lps = [-round(rng.random(), 4) for _ in range(n)]
        version = str(self.version)
        meta = {"id": body["rid"], "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": len(ids), "completion_tokens": n, "cached_tokens": 0,
                "weight_version": version,
                "weight_versions": [{"version": version, "start": 0, "end": n}],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out)]}
        if body.get("return_routed_experts"):  # routing replay: int32 [rows, layers, top_k]
            rows = expected_rows(len(ids), n)
            meta["routed_experts"] = encode(torch.tensor(
                [rng.randrange(4) for _ in range(rows * 2 * 2)]).reshape(rows, 2, 2))
        return 200, {"text": "".join(chr(t) for t in out), "output_ids": out, "meta_info": meta}

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


def context(tmp_path, url: str, mode: str, *, engine: bool = True, reward: dict | None = None,
            routing_replay: str = "none") -> LoopContext:
    """Rank 0's context in a run (``engine``: the client's spec, as the session sets it); the
    default model: 2 layers, top-2 of 4 experts."""
    cfg = config_from_dict({
        "gspo": {"group_size": 4, "routing_replay": routing_replay}, "reward": reward or {},
        "rollout": {"async": mode, "max_new_tokens": 8},
        "run": {"num_steps": 3, "global_batch_size": 8, "micro_batch_size": 4,
                "seq_length": 32, "eval_interval": 0}})
    spec = ClientSpec(router_url=None, server_urls=(url,))
    dataset = TaskPromptDataset(AdditionTask(digits=2, seed=0))
    client = build_client(spec)
    return LoopContext(cfg=cfg, run_dir=str(tmp_path), sampler=PromptSampler(dataset, seed=0),
                       reward_fn=build_reward(cfg.reward, cfg.data), client=client,
                       decode=dataset.encoder.decode, stop_token_ids=[dataset.encoder.eos_id],
                       logger=MetricsLogger(tmp_path, enabled=False), stop=StopFlag(),
                       engine=spec if engine else None)


def same_batch(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def same_metrics(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert {k: v for k, v in a.items() if k not in TIMINGS} == \
        {k: v for k, v in b.items() if k not in TIMINGS}


def one_step_run(source, server, steps=(1, 2)) -> list:
    """The loop's calls on rank 0 for ``steps`` (the servers' weights labelled after each)."""
    out = []
    for n in steps:
        out.append(source.next(n))
        source.before_weights_change()
        server.version = n
        source.weights_changed(n)
    return out


def test_one_step_in_its_process_makes_the_threads_batches_and_state(server, tmp_path):
    # with routing replay: each batch carries the routed experts (a checkpoint's largest tensor)
    remote = make_source(context(tmp_path / "p", server.url, "one_step",
                                 routing_replay="rollout"), 0)
    assert isinstance(remote, RemoteSource)
    thread = make_source(context(tmp_path / "t", server.url, "one_step", engine=False,
                                 routing_replay="rollout"), 0)
    assert isinstance(thread, OneStepSource)
    try:
        remote.restore({})
        assert remote.pid is not None and remote.pid != os.getpid()
        for sig in STOP_SIGNALS:  # a job-wide stop signal reaches it too: rank 0's to act on
            os.kill(remote.pid, sig)
        got, want = one_step_run(remote, server), None
        server.version = 0
        want = one_step_run(thread, server)
        for (gb, gm), (wb, wm) in zip(got, want):
            assert gb["routed_experts"].dtype == torch.int16 and gb["routed_experts"].any()
            same_batch(gb, wb)
            same_metrics(gm, wm)
        saved, expected = remote.state(), thread.state()  # step 3's batch, complete
        assert saved["sampler"] == expected["sampler"]
        assert saved[BUFFER_KEY]["step"] == expected[BUFFER_KEY]["step"] == 3
        same_batch(saved[BUFFER_KEY]["batch"], expected[BUFFER_KEY]["batch"])
        assert remote.busy_s() > 0
    finally:
        remote.close()
        thread.close()
    assert not _alive(remote.pid)
    resumed = make_source(context(tmp_path / "r", server.url, "one_step",
                                  routing_replay="rollout"), 2)
    try:  # a resumed run: the checkpoint's batch goes to a new producer and comes back
        resumed.restore(saved)
        batch, metrics = resumed.next(3)
        same_batch(batch, expected[BUFFER_KEY]["batch"])
        same_metrics(metrics, expected[BUFFER_KEY]["metrics"])
    finally:
        resumed.close()


def test_full_streams_in_its_process(server, tmp_path):
    remote = make_source(context(tmp_path / "p", server.url, "full"), 0)
    thread = StreamSource(context(tmp_path / "t", server.url, "full", engine=False), 0)
    try:
        for source in (remote, thread):
            source.restore({})
            source.start()
        (got, got_metrics), (want, want_metrics) = remote.next(1), thread.next(1)
        # which P groups complete first is the servers' timing: the same batch, not the same rows
        assert got.keys() == want.keys() and got_metrics.keys() == want_metrics.keys()
        assert all(got[k].shape == want[k].shape for k in got)
        assert got_metrics["admitted_version_min"] == 0.0 and got_metrics["dropped"] == 0.0
        remote.before_weights_change()
        remote.weights_changed(1)
        remote.next(2)
        state = remote.state()
        # 2 steps of P = 2 groups trained, more admitted; every prompt drawn there, once
        assert state[STREAM_KEY]["next_index"] >= 4
        assert state["sampler"]["index"] == state[STREAM_KEY]["next_index"]
    finally:
        remote.close()
        thread.close()


def test_an_error_in_the_producer_reaches_rank0_as_itself_naming_the_server(server, tmp_path):
    server.reject = True
    source = make_source(context(tmp_path, server.url, "one_step"), 0)
    try:
        t0 = time.monotonic()
        with pytest.raises(RolloutError) as err:
            source.next(1)
        assert time.monotonic() - t0 < 30
        assert err.value.url == server.url and err.value.status == 400
        assert "longer than the model's context length" in str(err.value)
        assert "rollout producer process" in err.value.__notes__
        server.reject = False  # the producer is still there, and works
        batch, _ = source.next(1)
        assert batch["tokens"].shape[0] == 8
    finally:
        source.close()


def test_the_producers_death_while_rank0_waits_is_one_line_not_a_hang(server, tmp_path):
    server.delay_s = 30.0
    source = make_source(context(tmp_path, server.url, "one_step"), 0)
    try:
        source.restore({})
        threading.Timer(1.0, os.kill, (source.pid, signal.SIGKILL)).start()
        with pytest.raises(ProducerGone, match=rf"rollout producer process \(pid {source.pid}, "
                                               r"rollout.async: one_step\) ended \(killed by "
                                               r"SIGKILL.*while waiting for next"):
            source.next(1)
        # the calls rank 0 makes outside a phase do not raise there (the other ranks would
        # wait in their next collective): the next phase's call does, on every rank
        source.weights_changed(1)
        assert source.busy_s() == 0.0
        with pytest.raises(ProducerGone, match="killed by SIGKILL"):
            source.before_weights_change()
    finally:
        server.delay_s = 0.0
        source.close()


def test_a_stop_signal_on_rank0_abandons_the_producers_reward_call(server, tmp_path):
    """Rank 0's stop flag reaches the producer (the note ``interrupt``): a user reward that
    blocks is abandoned at once, as it was on rank 0's own rollout thread, and the step sees
    ``RewardInterrupted``."""
    slow = tmp_path / "slow_reward.py"
    slow.write_text("import time\n\ndef reward(prompt, ids, text):\n    time.sleep(600)\n")
    ctx = context(tmp_path, server.url, "one_step",
                  reward={"kind": "function", "function": f"{slow}:reward", "timeout_s": 600.0})
    source = make_source(ctx, 0)
    try:
        source.restore({})
        threading.Timer(2.0, lambda: setattr(ctx.stop, "signum", signal.SIGTERM)).start()
        t0 = time.monotonic()
        with pytest.raises(RewardInterrupted, match="a stop signal came while"):
            source.next(1)
        assert time.monotonic() - t0 < 30
    finally:
        source.close()


PARENT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {root!r})
    from tests.reliability.test_producer_process import context
    from pipeline.sources.choice import make_source
    source = make_source(context(Path({run_dir!r}), {url!r}, "one_step"), 0)
    source.restore({{}})
    print("pid", source.pid, flush=True)
    time.sleep(600)
""")


def test_the_producer_dies_with_the_process_that_started_it(server, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(root=str(ROOT), run_dir=str(tmp_path),
                                             url=server.url)],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pid = _pid(parent)
        assert _alive(pid)
        parent.kill()  # SIGKILL: no cleanup runs in rank 0
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the producer outlived rank 0"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _pid(parent: subprocess.Popen) -> int:
    """The producer's pid, as the parent script prints it (after the producer's own line)."""
    for line in parent.stdout:
        if line.startswith("pid "):
            return int(line.split()[1])
    raise AssertionError(f"the parent ended (status {parent.wait()}) without a producer")
