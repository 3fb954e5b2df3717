"""The GSPO loop's control flow with the Megatron trainer and the servers replaced by recorders.

What is checked here is the loop's own logic (pipeline/loop.py): the order of phases, colocated
memory release/resume around training, and what a stop signal does when the rollout servers are
already gone (the consistent checkpoint). The real trainer and servers run in tests/e2e and
tests/slurm.
"""

from __future__ import annotations

import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.config import config_from_dict
from pipeline import loop
from pipeline.data import PromptSampler, TaskPromptDataset
from pipeline.metrics import MetricsLogger
from pipeline.rewards import build_reward
from pipeline.rollout import RolloutResult
from pipeline.tasks import AdditionTask, decode


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

    def sync_weights(self, version):
        self.rec.events.append(f"sync {version}")
        return {}

    def save(self, run_dir, step, run_state):
        self.rec.events.append(f"save {step}")
        self.saved.append((step, run_state))


class FakeClient:
    """Answers every prompt with the right sum for the first half of each group."""

    def __init__(self, rec: Recorder, fail_from_step: int | None = None, stop: loop.StopFlag = None):
        self.rec, self.calls, self.fail_from_step, self.stop = rec, 0, fail_from_step, stop

    def generate_groups(self, prompts, group_size, sampling, *, seed=None, **_):
        self.calls += 1
        self.rec.events.append("generate")
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
    """A real HTTP server that records release/resume_memory_occupation calls."""

    def __init__(self, rec: Recorder):
        outer = rec

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.events.append(f"{self.path} {body.get('tags')}")
                payload = b"null"
                self.send_response(200)
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


def _ctx(tmp_path, rec, client, *, colocated=False, server_urls=(), stop=None, steps=3):
    cfg = config_from_dict({
        "gspo": {"group_size": 4},
        "rollout": {"colocated": colocated},
        "run": {"num_steps": steps, "global_batch_size": 8, "micro_batch_size": 4,
                "seq_length": 16, "eval_interval": 0, "save_interval": 0},
    })
    dataset = TaskPromptDataset(AdditionTask(digits=2, seed=0))
    return loop.LoopContext(
        cfg=cfg, run_dir=str(tmp_path), sampler=PromptSampler(dataset, seed=0), eval_prompts=[],
        reward_fn=build_reward(cfg.reward, cfg.data), client=client, decode=decode,
        stop_token_ids=[10], logger=MetricsLogger(tmp_path, enabled=True, tensorboard=False),
        stop=stop or loop.StopFlag(), server_urls=list(server_urls))


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
    stop = loop.StopFlag()
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
    client = FakeClient(rec, fail_from_step=2, stop=loop.StopFlag())
    client.stop = type("NoSignal", (), {"signum": None})()  # the failure sets no signal
    ctx = _ctx(tmp_path, rec, client, steps=3)
    with pytest.raises(RuntimeError, match="step 2: ConnectionError: .*Cannot connect"):
        loop.run(ctx, FakeTrainer(rec), start_step=0)
