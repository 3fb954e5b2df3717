"""The GSPO loop's control flow with the Megatron trainer and the servers replaced by recorders.

What is checked here is the loop's own logic (pipeline/step/loop.py): the order of phases, colocated
memory release/resume around training, what a stop signal does when the rollout servers are
already gone (the consistent checkpoint), the sampling parameters and seeds of every request, and
``StepGuard``'s rules on their own. The real trainer and servers run in tests/e2e and tests/slurm.
"""

from __future__ import annotations

import json
import signal
import threading
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.config import config_from_dict
from megatron_gspo.errors import one_line
from pipeline.step import loop
from pipeline.context import LoopContext
from pipeline.signals import PREEMPTED_EXIT_CODE, StopFlag
from pipeline.sources.batch import MAX_DYNAMIC_SAMPLING_ROUNDS
from pipeline.step.rank0 import PhaseFailed, everywhere
from pipeline.step.step_guard import Preempted, StepGuard
from pipeline.scoring.data import PromptSampler, TaskPromptDataset
from pipeline.observe.metrics import MetricsLogger
from pipeline.scoring.rewards import build_reward
from pipeline.generation.client import RolloutResult, eval_seed, rollout_seed, sampling_params
from pipeline.scoring.tasks import AdditionTask, decode


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recorder:
    """The events of a run, in order, from every stand-in."""

    def __init__(self):
        self.events: list[str] = []


class FakeTrainer:
    def __init__(self, rec: Recorder):
        self.rec, self.saved = rec, []

    def train_rollout(self, batch, step):
        self.rec.events.append(f"train {step}")
        return {"clip_frac": 0.0}

    def hf_buckets(self):
        return []

    def save(self, run_dir, step, run_state):
        self.rec.events.append(f"save {step}")
        self.saved.append((step, run_state))


class FakePusher:
    """Stands in for pipeline.weights.push.WeightPusher: records each push."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def push(self, buckets, version):
        self.rec.events.append(f"sync {version}")
        return SimpleNamespace(metrics=dict)


class FakeClient:
    """Answers every prompt with the right sum for the first half of each group."""

    def __init__(self, rec: Recorder, fail_from_step: int | None = None, stop: StopFlag = None):
        self.rec, self.calls, self.fail_from_step, self.stop = rec, 0, fail_from_step, stop
        self.requests = []  # (sampling params, base seed) of every call

    def generate_groups(self, prompts, group_size, sampling, *, seed=None, **_):
        self.calls += 1
        self.rec.events.append("generate")
        self.requests.append((sampling, seed))
        if self.fail_from_step is not None and self.calls >= self.fail_from_step:
            self.stop.signum = signal.SIGTERM  # Slurm signalled everyone; the server is gone
            raise ConnectionError("http://127.0.0.1:1: Cannot connect")
        groups = []
        for ids in prompts:
            a, b = decode(ids).rstrip("=").split("+")
            right = list(str(int(a) + int(b)).encode()) + [10]
            group = []
            for s in range(group_size):
                out = right if s < group_size // 2 else [ord("x"), 10]
                group.append(RolloutResult(rid=f"r{s}", prompt_ids=list(ids), output_ids=out,
                                           output_logprobs=[-0.5] * len(out), finish_reason="stop",
                                           matched_stop=10, prompt_tokens=len(ids),
                                           completion_tokens=len(out), weight_version="0",
                                           server_url="fake"))
            groups.append(group)
        return groups


class ControlServer:
    """A real HTTP server that records release/resume_memory_occupation calls; ``fail`` (the
    event text of one call) makes that call answer 500 and signal ``stop`` (Slurm stopping the
    job while the server goes down)."""

    def __init__(self, rec: Recorder, *, fail: str | None = None, stop: StopFlag = None):
        outer = rec

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                event = f"{self.path} {body.get('tags')}"
                outer.events.append(event)
                payload = b"null"
                if event == fail:
                    stop.signum = signal.SIGTERM
                    payload = b'{"error": "server shutting down"}'
                self.send_response(500 if event == fail else 200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def _ctx(tmp_path, rec, client, *, colocated=False, server_urls=(), stop=None, steps=3,
         eval_interval=0, rollout=None):
    cfg = config_from_dict({
        "gspo": {"group_size": 4},
        "rollout": {"colocated": colocated, **(rollout or {})},
        "run": {"num_steps": steps, "global_batch_size": 8, "micro_batch_size": 4,
                "seq_length": 16, "eval_interval": eval_interval, "save_interval": 0},
    })
    dataset = TaskPromptDataset(AdditionTask(digits=2, seed=0))
    return LoopContext(
        cfg=cfg, run_dir=str(tmp_path), sampler=PromptSampler(dataset, seed=0),
        eval_prompts=[dataset[i] for i in range(2)] if eval_interval else [],
        reward_fn=build_reward(cfg.reward, cfg.data), client=client, decode=decode,
        stop_token_ids=[10], logger=MetricsLogger(tmp_path, enabled=True, tensorboard=False),
        stop=stop or StopFlag(), server_urls=list(server_urls), weights=FakePusher(rec))


def test_phases_in_order_and_advantages_from_rewards(tmp_path):
    rec = Recorder()
    ctx = _ctx(tmp_path, rec, FakeClient(rec), steps=2)
    batches = []
    trainer = FakeTrainer(rec)
    original = trainer.train_rollout
    trainer.train_rollout = lambda batch, step: (batches.append(batch), original(batch, step))[1]
    result = loop.run(ctx, trainer, start_step=0)
    assert result["status"] == "finished"
    assert rec.events == ["sync 0", "generate", "train 1", "sync 1", "generate", "train 2",
                          "sync 2", "save 2"]
    adv = batches[0]["advantages"].view(2, 4)
    assert torch.all(adv[:, :2] > 0) and torch.all(adv[:, 2:] < 0)  # right answers are favoured
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[0]["train/reward_mean"] == 0.5


def test_colocated_servers_release_memory_around_training(tmp_path):
    rec = Recorder()
    server = ControlServer(rec)
    try:
        ctx = _ctx(tmp_path, rec, FakeClient(rec), colocated=True, server_urls=[server.url], steps=1)
        loop.run(ctx, FakeTrainer(rec), start_step=0)
    finally:
        server.close()
    assert rec.events == ["sync 0", "generate", "/release_memory_occupation None", "train 1",
                          "/resume_memory_occupation ['weights']", "sync 1",
                          "/resume_memory_occupation ['kv_cache', 'cuda_graph']", "save 1"]


def test_signal_with_servers_gone_checkpoints_the_last_consistent_step(tmp_path):
    rec = Recorder()
    stop = StopFlag()
    client = FakeClient(rec, fail_from_step=3, stop=stop)
    ctx = _ctx(tmp_path, rec, client, stop=stop, steps=5)
    trainer = FakeTrainer(rec)
    result = loop.run(ctx, trainer, start_step=0)
    assert result["status"] == "preempted"
    # steps 1 and 2 trained; step 3's rollout failed under the signal: checkpoint of step 2
    assert rec.events[-2:] == ["generate", "save 2"]
    step, state = trainer.saved[-1]
    # the data position is the one from before step 3 drew its prompts: 2 steps x 2 prompts
    assert step == 2 and state["sampler"]["index"] == 4


def test_failure_without_a_signal_is_an_error(tmp_path):
    rec = Recorder()
    client = FakeClient(rec, fail_from_step=2, stop=StopFlag())
    client.stop = type("NoSignal", (), {"signum": None})()  # the failure sets no signal
    ctx = _ctx(tmp_path, rec, client, steps=3)
    with pytest.raises(ConnectionError, match="Cannot connect") as info:  # rank 0's, as its type
        loop.run(ctx, FakeTrainer(rec), start_step=0)
    assert one_line(info.value).startswith("step 2: ConnectionError: ")  # where, for the launcher


def test_a_failed_resume_after_the_update_under_a_signal_saves_the_trained_step(tmp_path):
    """The servers' weight memory cannot come back (Slurm is stopping them) AFTER step 1's update:
    step 1 is checkpointed (the trainer's weights are step 1's), without the sync."""
    rec = Recorder()
    stop = StopFlag()
    server = ControlServer(rec, fail="/resume_memory_occupation ['weights']", stop=stop)
    try:
        ctx = _ctx(tmp_path, rec, FakeClient(rec), colocated=True, server_urls=[server.url],
                   stop=stop, steps=3)
        trainer = FakeTrainer(rec)
        result = loop.run(ctx, trainer, start_step=0)
    finally:
        server.close()
    assert result["status"] == "preempted"
    assert rec.events == ["sync 0", "generate", "/release_memory_occupation None", "train 1",
                          "/resume_memory_occupation ['weights']", "save 1"]
    step, state = trainer.saved[-1]
    assert step == 1 and state["sampler"]["index"] == 2  # the data position after step 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]  # step 1 is logged


def test_generation_and_evaluation_sample_with_the_configured_params_and_named_seeds(tmp_path):
    rec = Recorder()
    client = FakeClient(rec)
    ctx = _ctx(tmp_path, rec, client, steps=2, eval_interval=2,
               rollout={"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 5})
    loop.run(ctx, FakeTrainer(rec), start_step=0)
    expected = sampling_params(ctx.cfg.rollout, [10])
    assert (expected.temperature, expected.top_p, expected.top_k, expected.max_new_tokens,
            expected.stop_token_ids) == (0.7, 0.9, 20, 5, [10])
    seed = ctx.cfg.run.seed
    # eval at step 0, rollouts of steps 1 and 2, eval at step 2 (the same seed: common noise)
    assert client.requests == [(expected, eval_seed(seed)), (expected, rollout_seed(seed, 1, 0)),
                               (expected, rollout_seed(seed, 2, 0)), (expected, eval_seed(seed))]


def test_rollout_seeds_are_distinct_for_every_step_round_and_run():
    seeds = {rollout_seed(run, step, round_) for run in (0, 1, 1234) for step in range(200)
             for round_ in range(MAX_DYNAMIC_SAMPLING_ROUNDS + 1)}
    seeds |= {eval_seed(run) for run in (0, 1, 1234)}
    assert len(seeds) == 3 * 200 * (MAX_DYNAMIC_SAMPLING_ROUNDS + 1) + 3
    assert rollout_seed(1234, 5, 0) == rollout_seed(1234, 5, 0)  # a resumed run redraws them
    assert all(0 <= s < 2 ** 62 for s in seeds)


# --- StepGuard: the failure / preemption rules on their own -------------------------------------


class CountingStop(StopFlag):
    """A StopFlag that counts its collectives (each any_rank is one all-reduce)."""

    def __init__(self):
        super().__init__()
        self.collectives = 0

    def any_rank(self) -> bool:
        self.collectives += 1
        return super().any_rank()


def _guard(start_step=0):
    saves, position = [], {"index": 0}
    stop = CountingStop()
    guard = StepGuard(stop, save=lambda step, pos: saves.append((step, dict(pos))),
                           data_position=lambda: dict(position), start_step=start_step)
    return guard, stop, saves, position


def test_guard_failure_without_a_signal_is_an_error_naming_the_step():
    guard, _, saves, _ = _guard()
    guard.begin(1)
    with pytest.raises(RuntimeError, match=r"^step 1: evaluation: ConnectionError: gone$"):
        with guard.before_update():
            raise PhaseFailed("evaluation: ConnectionError: gone")
    guard.begin(2)
    with pytest.raises(RuntimeError, match=r"^step 2: resume server memory: 500$"):
        with guard.after_update():
            raise PhaseFailed("resume server memory: 500")
    assert saves == []


def test_guard_failed_collective_without_a_signal_raises_its_own_error():
    guard, _, _, _ = _guard()
    guard.begin(1)
    with pytest.raises(OSError, match="disk full"):
        with guard.after_update():
            everywhere(lambda: (_ for _ in ()).throw(OSError("disk full")), what="weight sync")


def test_guard_signal_before_the_update_saves_the_previous_step_at_its_data_position():
    guard, stop, saves, position = _guard()
    guard.begin(1)
    guard.end(save_due=False, last=False)  # step 1 done, not saved
    position["index"] = 2
    guard.begin(2)
    position["index"] = 4  # step 2 drew its prompts, then its rollout failed under a signal
    stop.signum = signal.SIGTERM
    with pytest.raises(Preempted, match="ConnectionError"):
        with guard.before_update():
            raise PhaseFailed("ConnectionError: gone")
    assert saves == [(1, {"index": 2})]


def test_guard_signal_after_the_update_skips_the_rest_then_saves_this_step():
    guard, stop, saves, position = _guard()
    guard.begin(1)
    ran = []

    def sync():
        stop.signum = signal.SIGTERM
        raise PhaseFailed("weight sync: refused")

    with guard.after_update():
        sync()
        ran.append("eval")  # skipped
    assert ran == [] and guard.interrupted == "weight sync: refused"
    position["index"] = 2
    with pytest.raises(Preempted, match="weight sync: refused"):
        guard.end(save_due=False, last=False)
    assert saves == [(1, {"index": 2})]


def test_guard_signal_at_the_last_step_finishes_with_the_checkpoint():
    guard, stop, saves, _ = _guard(start_step=4)
    guard.begin(5)
    stop.signum = signal.SIGUSR1
    guard.end(save_due=False, last=True)  # no Preempted: the run is complete
    assert saves == [(5, {"index": 0})]


def test_guard_never_saves_the_start_step_or_a_step_twice():
    guard, stop, saves, _ = _guard(start_step=3)
    stop.signum = signal.SIGTERM
    with pytest.raises(Preempted):
        guard.begin(4)  # signalled before anything was trained: the step-3 checkpoint stands
    assert saves == []
    guard, stop, saves, _ = _guard(start_step=3)
    guard.begin(4)
    guard.end(save_due=True, last=False)
    stop.signum = signal.SIGTERM
    with pytest.raises(Preempted, match="signal between steps"):
        guard.begin(5)
    assert saves == [(4, {"index": 0})]  # saved when due, not again on the signal


def test_guard_lets_other_exceptions_through_without_a_collective():
    """A bug on one rank is not a failure all ranks share: no all-reduce may run for it."""
    guard, stop, saves, _ = _guard()
    guard.begin(1)
    before = stop.collectives
    with pytest.raises(KeyError):
        with guard.before_update():
            raise KeyError("reward_mean")
    with pytest.raises(ZeroDivisionError):
        with guard.after_update():
            raise ZeroDivisionError
    assert stop.collectives == before and saves == []


@pytest.mark.parametrize("start_step", [0, 3])
def test_a_signal_during_start_up_does_not_claim_a_checkpoint(tmp_path, capsys, start_step):
    """Issue 22, lesser finding: stopped before any step finished, nothing is saved (the start
    needs no checkpoint), and neither the loop nor the session's summary says one was."""
    from launch.rl_session import RLSession

    rec = Recorder()
    stop = StopFlag()
    stop.signum = signal.SIGTERM  # arrived while the session was starting
    ctx = _ctx(tmp_path, rec, FakeClient(rec), stop=stop, steps=5)
    result = loop.run(ctx, FakeTrainer(rec), start_step=start_step)
    assert result["status"] == "preempted" and result["saved"] is False
    assert not any(e.startswith("save") for e in rec.events)
    session = SimpleNamespace(is_main=True, cfg=ctx.cfg, run_dir=tmp_path)
    assert RLSession._finish(session, None, result) == PREEMPTED_EXIT_CODE
    out = capsys.readouterr().out
    assert "; checkpoint saved" not in out and "preempted: checkpoint saved" not in out, out
    assert f"no checkpoint saved (no step finished after step {start_step})" in out
    assert f"preempted before a step finished: no checkpoint saved (nothing done after step " \
           f"{start_step}); exit {PREEMPTED_EXIT_CODE}" in out


def test_a_signal_after_a_step_still_says_checkpoint_saved(tmp_path, capsys):
    from launch.rl_session import RLSession

    rec = Recorder()
    stop = StopFlag()
    client = FakeClient(rec, fail_from_step=3, stop=stop)
    ctx = _ctx(tmp_path, rec, client, stop=stop, steps=5)
    result = loop.run(ctx, FakeTrainer(rec), start_step=0)
    assert result["saved"] is True and rec.events[-1] == "save 2"
    RLSession._finish(SimpleNamespace(is_main=True, cfg=ctx.cfg, run_dir=tmp_path), None, result)
    out = capsys.readouterr().out
    assert "checkpoint saved (step 2)" in out and "preempted: checkpoint saved; exit 75" in out


def test_the_step_drives_its_batch_source_through_the_protocol_only(tmp_path):
    """The step knows no rollout mode: it calls the source's methods, in this order, around the
    update and the weight sync (``pipeline.sources.base.BatchSource``)."""

    class Source:
        mode = "test"

        def __init__(self, inner):
            self.inner = inner

        def restore(self, saved):
            raise AssertionError("the loop never restores: the session does")

        def start(self):
            rec.events.append("start")

        def next(self, step):
            rec.events.append(f"next {step}")
            return self.inner.next(step)

        def before_weights_change(self):
            rec.events.append("before change")
            return {"trainer_wait_rollout_s": 0.25}

        def weights_changed(self, version):
            rec.events.append(f"changed {version}")

        def state(self):
            return self.inner.state()

        def busy_s(self):
            return 0.0

        def close(self):
            rec.events.append("close")

    from pipeline.sources.choice import make_source

    rec = Recorder()
    ctx = _ctx(tmp_path, rec, FakeClient(rec), steps=2)
    result = loop.run(ctx, FakeTrainer(rec), start_step=0, source=Source(make_source(ctx, 0)))
    assert result["status"] == "finished"
    assert rec.events == ["sync 0", "start",
                          "next 1", "generate", "train 1", "before change", "sync 1", "changed 1",
                          "next 2", "generate", "train 2", "before change", "sync 2", "changed 2",
                          "save 2", "close"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/trainer_wait_rollout_s"] for r in records] == [0.25, 0.25]
