"""Issue 11, item 4 (and the log half of item 8): a rollout server that dies does not end the run.

The probe SIGKILLed one of two embedded servers: the router routed generation around it, but the
next weight sync failed and ended the run; nothing restarted it. Here:

* ``ServerPool`` with the real sglang-router and two real ``megatron-gspo serve`` processes: a
  killed server is taken out of the router, restarted on its port, kept out of the router until
  :meth:`admit` (after the sync that gives it the current weights), and the router only ever
  routes to servers that hold them; below ``min_servers`` (a restart that fails) the error
  names the server and why; the servers' and the router's logs rotate at their size bound;
* the GSPO loop (``pipeline.step.loop.run``, stand-in trainer) pushes to the pool's members and logs
  ``rollout/servers_alive`` and ``rollout/server_restarts``;
* ``RotatingLog`` on its own: a child writing 1 MB leaves at most (backups + 1) files of at most
  max_bytes each, whole lines, the newest output kept;
* issue 22 item 5, a server that dies DURING a rollout: the only server behind the router
  SIGKILLed while a batch is in flight - the batch waits, the pool restarts it, the loop's weight
  sync (``run_on_rank0``'s mid-phase resync, the real distributed push) gives it the current weights
  before the router sees it again, the failed requests are sent again: one sample per request,
  the finished ones kept, none served by the unsynced server, the restart and the re-sends
  counted; a server that cannot come back fails the rollout after ``outage_timeout_s`` naming
  it and the wait; external mode waits for the server to answer again (or names the router);
  the RESYNC protocol of ``pipeline.step.rank0.run_on_rank0`` on two ranks;
* slow: ``megatron-gspo train`` (2 ranks, 2 embedded servers, the disk weight sync), one server
  SIGKILLed after step 1: the run finishes, exit 0, with one restart logged and both servers
  serving at the end; and (1 server) the only server SIGKILLed during step 2's rollout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from pipeline.step import loop
from pipeline.context import LoopContext
from pipeline.step.phases import sync_weights
from pipeline.step.rank0 import PhaseFailed, on_main
from pipeline.generation.client import RolloutClient, SamplingParams, http_json
from pipeline.servers.pool import ServerPool, ServerPoolError, SyncChannel
from pipeline.servers.cluster import LocalRolloutCluster, RotatingLog
from tests.reliability.conftest import Run, metric_steps, tagged_pids, train_args
from tests.reliability.loop_fakes import FakeTrainer, init_world_of_one, loop_context
from tests.rollout.tiny import make_model_dir

LOG_MAX = 16 << 10


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("dead_server")
    model = make_model_dir(base / "model")
    with LocalRolloutCluster(model, 2, log_dir=base / "logs", router_policy="round_robin",
                             log_max_bytes=LOG_MAX, log_backups=2) as c:
        yield c


def router_urls(cluster) -> set[str]:
    return {w["url"].rstrip("/") for w in http_json("GET", cluster.router_url + "/workers")[1]
            ["workers"]}


def finished(url: str) -> int:
    return http_json("GET", url + "/server_info")[1]["internal_states"][0]["num_finished_reqs"]


def generate(cluster, n_prompts: int = 8) -> None:
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60)
    client.generate_groups([[5 + i, 6, 7] for i in range(n_prompts)], 2,
                           SamplingParams(max_new_tokens=4), seed=1)


def test_a_killed_server_is_restarted_out_of_the_router_until_admitted(cluster):
    urls = [u.rstrip("/") for u in cluster.server_urls]
    pool = ServerPool(cluster.server_urls, router_url=cluster.router_url, cluster=cluster)
    assert pool.check() == urls
    assert pool.metrics() == {"rollout/servers_alive": 2.0, "rollout/server_restarts": 0.0,
                              "rollout/requests_retried": 0.0}
    old_pid = cluster._procs["server1"].pid
    cluster.kill_server(1)  # SIGKILL, as a crash or the OOM killer would
    members = pool.check()
    assert members == urls  # server 1 restarted: it is in the next sync
    assert pool.take_renewed() == [urls[1]]  # a new process: its update groups are made again
    assert cluster.server_alive(1) and cluster._procs["server1"].pid != old_pid
    assert router_urls(cluster) == {urls[0]}  # ... but not in the router before that sync
    assert pool.metrics() == {"rollout/servers_alive": 1.0, "rollout/server_restarts": 1.0,
                              "rollout/requests_retried": 0.0}
    before = [finished(u) for u in urls]
    generate(cluster)
    after = [finished(u) for u in urls]
    assert after[0] > before[0] and after[1] == before[1]  # nothing reached the pending server
    assert pool.admit() == [urls[1]]  # the sync went through: back in the router
    assert router_urls(cluster) == set(urls)
    assert pool.metrics() == {"rollout/servers_alive": 2.0, "rollout/server_restarts": 1.0,
                              "rollout/requests_retried": 0.0}
    before = [finished(u) for u in urls]
    generate(cluster)
    assert finished(urls[1]) > before[1]  # it serves again


def test_below_min_servers_the_error_names_the_server(cluster, monkeypatch):
    urls = [u.rstrip("/") for u in cluster.server_urls]
    pool = ServerPool(cluster.server_urls, router_url=cluster.router_url, cluster=cluster,
                      min_servers=2)
    cluster.kill_server(0)
    monkeypatch.setattr(cluster, "model_path", "/nonexistent/model")  # its restart fails
    with pytest.raises(ServerPoolError) as err:
        pool.check()
    text = str(err.value)
    assert "only 1 of 2 rollout servers left, rollout.min_servers is 2" in text, text
    assert urls[0] in text and "exited with status" in text and "restart failed" in text, text
    monkeypatch.undo()
    cluster.restart_server(0)  # leave the module's cluster whole
    assert router_urls(cluster) == set(urls)


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 6, 7 + (i % 3)] for i in range(n)]


class Trainer:
    """The trainer's side of ``sync_weights``: HF tensors as a bucket stream."""

    def __init__(self, weights: dict):
        self.weights = weights

    def hf_buckets(self):
        return TensorStream(self.weights)


def perturbed_weights(cluster, seed: int) -> dict:
    import torch
    from safetensors.torch import load_file

    base = load_file(str(Path(cluster.model_path) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}


class KillWhenBusy(threading.Thread):
    """SIGKILLs server ``index`` once ``done`` of its requests have finished (counted from now)
    and more run: it dies mid-batch, some samples in, others in flight.

    It pauses the server in place first (its running requests held, none finishing), gives the
    answers already finished time to reach their clients, and kills only if requests are still
    held: a SIGKILL right after a request finished could lose its answer in flight (retried, so
    fewer kept than finished), and a fixed wait without the pause let a fast machine finish the
    whole batch first (nothing left to kill)."""

    def __init__(self, cluster, index: int, done: int):
        super().__init__(daemon=True)
        self.cluster, self.index, self.url = cluster, index, cluster.server_urls[index].rstrip("/")
        self.start_count, self.done = finished(self.url), done
        self.killed = threading.Event()

    def run(self):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            load = http_json("GET", self.url + "/v1/loads")[1]["loads"][0]
            if (load["num_running_reqs"] > 0
                    and finished(self.url) - self.start_count >= self.done):
                http_json("POST", self.url + "/pause_generation", {"mode": "in_place"})
                time.sleep(0.3)  # the finished answers reach their clients
                load = http_json("GET", self.url + "/v1/loads")[1]["loads"][0]
                if load["num_running_reqs"] > 0:
                    self.cluster.kill_server(self.index)  # SIGKILL: dies mid-request
                    self.killed.set()
                    return
                http_json("POST", self.url + "/continue_generation", {})
            time.sleep(0.01)


@pytest.fixture
def only_server(cluster):
    """Server 0 alone behind the router (server 1 out of it) during the test."""
    cluster.deregister(1)
    try:
        yield cluster.server_urls[0].rstrip("/")
    finally:
        if not cluster.server_alive(0):
            cluster.restart_server(0)
        cluster.register(0)
        cluster.register(1)


def only_server_rollout(cluster, url: str, weights: dict, pusher, tmp_path):
    """(pool, client, loop context, trainer) of a rollout whose only server is ``url``: synced to the
    trainer's ``weights`` as version 6, the trainer's weights then called 7 (a new label); a
    restarted server gets them through ``ctx.resync``, as in ``loop.run``."""
    pool = ServerPool([url], router_url=cluster.router_url, cluster=cluster, outage_timeout_s=120)
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60,
                           max_concurrency=8, servers=pool)
    ctx = loop_context(tmp_path, steps=1, client=client, pusher=pusher, servers=pool)
    trainer = Trainer(weights)
    ctx.resync = lambda version: sync_weights(ctx, trainer, version)  # as loop.run
    sync_weights(ctx, trainer, 6)  # the server holds version 6
    ctx.weights_version = 7  # what the trainer's weights are called now (a new label)
    return pool, client, ctx, trainer


def test_a_rollout_waits_for_its_only_server_to_come_back_synced(cluster, only_server, tmp_path):
    """Kill the only server while a batch is in flight: the batch completes after the restart,
    one sample per request, the finished ones kept; the restarted server serves only after the
    loop's weight sync gave it the current weights (no sample has its initial label)."""
    from pipeline.weights.push import WeightPusher
    from pipeline.weights.transport import weights_checksum

    url = only_server
    weights = perturbed_weights(cluster, 6)
    made = init_world_of_one()
    pusher = WeightPusher([url], transport="distributed", verify=True)
    try:
        # waves of 8 requests: some finish before the kill, some are in flight, some not sent
        pool, client, ctx, _ = only_server_rollout(cluster, url, weights, pusher, tmp_path)
        killer = KillWhenBusy(cluster, 0, done=8)
        killer.start()
        t0 = time.monotonic()
        groups = on_main(ctx, lambda: client.generate_groups(
            prompts(8), 4, SamplingParams(max_new_tokens=48), seed=5))
        took = time.monotonic() - t0
        killer.join()
        ctx.logger.close()
        assert killer.killed.is_set()
        results = [r for g in groups for r in g]
        assert len(results) == 32 and len({r.rid for r in results}) == 32  # one per request
        assert all(r.prompt_ids == p for g, p in zip(groups, prompts(8)) for r in g)
        assert all(r.finish_reason in ("stop", "length") and r.completion_tokens > 0
                   for r in results)
        versions = [r.weight_version for r in results]
        assert set(versions) == {6, 7}, versions  # kept from before; resumed after the sync
        assert versions.count(6) >= 8
        assert pool.restarts == 1 and cluster.server_alive(0)
        assert pool.requests_retried == client.requests_retried > 0
        assert pool.metrics() == {"rollout/servers_alive": 1.0, "rollout/server_restarts": 1.0,
                                  "rollout/requests_retried": float(pool.requests_retried)}
        got = http_json("POST", url + "/weights_checker", {"action": "checksum"})[1]
        assert got["checksum"] == weights_checksum(weights.items())
        assert http_json("GET", url + "/model_info")[1]["weight_version"] == "7"
        assert router_urls(cluster) == {url}
        assert took < 90, took
    finally:
        pusher.close()
        if made:
            dist.destroy_process_group()


def test_full_mode_the_trainers_sync_reaches_a_server_the_stream_waits_for(cluster, only_server,
                                                                           tmp_path):
    """``rollout.async: full``: the only server dies while the stream's groups are in flight and
    the trainer trains (no channel open: the stream's wait restarts the server but cannot sync
    it). The trainer's own weight sync after its update opens the channel before it checks the
    pool, so the stream's wait syncs the restarted server through it (with the weights just
    trained) and lets the check through; the stream's groups complete, one sample per request,
    none aborted, none served by the unsynced server."""
    from pipeline.scoring.data import Prompt
    from pipeline.sources.stream import RolloutStream
    from pipeline.weights.push import WeightPusher

    url = only_server
    weights = perturbed_weights(cluster, 6)
    made = init_world_of_one()
    pusher = WeightPusher([url], transport="distributed", verify=True)
    stream = None
    try:
        pool, client, ctx, trainer = only_server_rollout(cluster, url, weights, pusher, tmp_path)
        sampling = SamplingParams(max_new_tokens=48)

        async def generate(prompt, seed, rid):
            return (await client.generate_groups_async([prompt.prompt_ids], 4, sampling, seed=seed,
                                                       rid_prefix=rid))[0]

        drawn = iter(range(100))

        def draw():
            i = next(drawn)
            return Prompt(index=i, prompt_ids=prompts(8)[i % 8], label=None, text="",
                          origin=f"p{i}")
        stream = RolloutStream(generate=generate, score=lambda p, rs: ([0.0] * len(rs), 0),
                               draw=draw, prompts_per_step=4, max_staleness=1, version=6,
                               taken=6, seed_of=lambda i, a: 100 * i + a)
        killer = KillWhenBusy(cluster, 0, done=0)  # the stream's requests finish together
        killer.start()
        stream.start()
        killer.join()
        assert killer.killed.is_set()
        time.sleep(2.0)  # "training": the stream's requests wait for a live server
        t0 = time.monotonic()
        sync_weights(ctx, trainer, 7)  # the loop's sync after the update
        took = time.monotonic() - t0
        stream.set_version(7)
        groups = stream.take(7)
        ctx.logger.close()
        assert took < 60, f"the trainer's sync waited {took:.0f} s for the pool"
        results = [r for g in groups for r in g.results]
        assert len(results) == 16 and all(r.finish_reason in ("stop", "length") for r in results)
        assert pool.restarts == 1 and cluster.server_alive(0)
        assert {r.weight_version for r in results} <= {6, 7}
        assert http_json("GET", url + "/model_info")[1]["weight_version"] == "7"
    finally:
        if stream is not None:
            stream.close()
        pusher.close()
        if made:
            dist.destroy_process_group()


def test_a_rollout_whose_server_cannot_come_back_names_it_and_the_wait(cluster, only_server,
                                                                       monkeypatch):
    url = only_server
    pool = ServerPool([url], router_url=cluster.router_url, cluster=cluster, outage_timeout_s=5)
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60, servers=pool,
                           retry_backoff_s=0.05)
    cluster.kill_server(0)
    monkeypatch.setattr(cluster, "model_path", "/nonexistent/model")  # every restart fails
    t0 = time.monotonic()
    with pytest.raises(ServerPoolError) as err:
        client.generate_groups(prompts(2), 2, SamplingParams(max_new_tokens=4), seed=1)
    took = time.monotonic() - t0
    monkeypatch.undo()
    text = str(err.value)
    assert text.startswith("rollout: no live server for 5 s (server 0 at "), text
    assert f"server 0 at {url}: its process exited with status -9" in text, text
    assert "its restart failed" in text and "/nonexistent/model" in text, text
    assert pool.restarts == 0
    assert took < 60, took  # the deadline, plus the restart that was under way


def test_external_mode_waits_for_the_router_to_have_a_server_again(cluster, only_server):
    """Servers that are not ours: the pool cannot restart them. Without a server the rollout
    fails after its bound naming the router; when the server is started again (by whoever runs
    it), or a new worker appears in the router, the waiting batch syncs it (here a stand-in
    sync: check and admit) before the router routes to it, and completes."""
    url = only_server
    cluster.kill_server(0)
    pool = ServerPool([url], router_url=cluster.router_url, outage_timeout_s=3)
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60, servers=pool,
                           retry_backoff_s=0.05)
    with pytest.raises(ServerPoolError) as err:
        client.generate_groups(prompts(2), 2, SamplingParams(max_new_tokens=4), seed=1)
    text = str(err.value)
    assert text.startswith(f"rollout: no live server for 3 s ({url}: /health: "), text
    assert f"router {cluster.router_url}: workers none" in text, text

    synced = []

    def sync():  # what sync_weights does with the pool around its push
        members = pool.check()
        synced.append((members, pool.take_renewed()))
        pool.admit()

    pool.outage_timeout_s = 120
    operator = threading.Timer(0.5, lambda: cluster.restart_server(0, register=False))
    operator.start()
    with pool.channel.opened(sync):
        groups = client.generate_groups(prompts(4), 2, SamplingParams(max_new_tokens=8), seed=2)
    operator.join()
    results = [r for g in groups for r in g]
    assert len({r.rid for r in results}) == 8
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert synced == [([url], [url])]  # synced once, before it was back in the router
    assert router_urls(cluster) == {url} and pool.restarts == 0

    # a replacement under another URL, registered with the router by whoever runs it
    cluster.kill_server(0)
    other = cluster.server_urls[1].rstrip("/")
    pool = ServerPool([url], router_url=cluster.router_url, outage_timeout_s=120)
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60, servers=pool,
                           retry_backoff_s=0.05)
    synced.clear()
    operator = threading.Timer(0.5, lambda: cluster.register(1))
    operator.start()
    with pool.channel.opened(sync):
        groups = client.generate_groups(prompts(4), 2, SamplingParams(max_new_tokens=8), seed=3)
    operator.join()
    assert len({r.rid for g in groups for r in g}) == 8
    assert synced == [([other], [other])]  # taken out of the router, synced, admitted
    assert router_urls(cluster) == {other} and pool.metrics()["rollout/servers_alive"] == 1.0


def _resync_protocol_rank(rank: int, store_path: str, out_dir: str) -> None:
    """One rank of the two-rank check of ``run_on_rank0``'s mid-phase resync."""
    import torch

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        calls = []

        def resync(version):
            total = torch.tensor([1.0])
            dist.all_reduce(total)  # a collective: every rank must be in it
            calls.append((version, float(total)))
            if version == "bad":
                raise RuntimeError("push failed")

        servers = type("Pool", (), {"channel": SyncChannel()})() if rank == 0 else None
        ctx = LoopContext(cfg=None, run_dir=out_dir, logger=None, stop=None,
                               servers=servers, resync=resync)
        outcomes = []
        for version in ("5", "bad"):
            ctx.weights_version = version

            def phase():  # the rollout's hook asks from another thread, as the client does
                box = []
                worker = threading.Thread(target=lambda: box.append(_run(servers.channel)))
                worker.start()
                worker.join()
                if isinstance(box[0], BaseException):
                    raise box[0]
                return box[0]
            try:
                outcomes.append(on_main(ctx, phase, what="rollout"))
            except PhaseFailed as failed:
                outcomes.append(failed.message)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"calls": calls,
                                                                 "outcomes": outcomes}))
    finally:
        dist.destroy_process_group()


def _run(channel):
    try:
        return channel.run(timeout_s=30)
    except BaseException as err:  # noqa: BLE001 - handed to the phase
        return err


def test_on_main_runs_a_resync_on_every_rank_mid_phase(tmp_path):
    """Rank 0's phase asks for a weight sync through the pool's channel: every rank runs it (a
    collective) inside the same ``on_main``, then receives the phase's outcome; a sync that
    fails on every rank fails the phase on every rank."""
    import torch.multiprocessing as mp

    mp.spawn(_resync_protocol_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["calls"] == [["5", 2.0], ["bad", 2.0]], (rank, got)
        assert got["outcomes"][0] is True, (rank, got)
        assert got["outcomes"][1] == "rollout: RuntimeError: push failed", (rank, got)


def test_one_step_a_resync_asked_while_the_trainer_trains_waits_for_it(tmp_path):
    """``rollout.async: one_step``: step 2's rollout runs on the producer thread while step 1
    trains. A sync it asks for then (a server came back) runs once every rank can take part -
    when the loop waits for that rollout - with the weights just trained (version 1)."""
    from types import SimpleNamespace

    from megatron_gspo.config import config_from_dict
    from tests.reliability.loop_fakes import FakeClient

    class Pool:  # what the loop sees of a ServerPool
        channel, events = SyncChannel(), 0

        def check(self):
            return ["http://a"]

        def take_renewed(self):
            return []

        def admit(self):
            return []

        def readmitted(self):  # the router routes to every server at once
            return 0.0

        def metrics(self):
            return {}

    class Pusher:
        def __init__(self):
            self.pushes = []

        def set_servers(self, urls, *, renewed=()):
            pass

        def push(self, buckets, version):
            self.pushes.append((version, threading.current_thread() is threading.main_thread()))
            return SimpleNamespace(metrics=dict)

    class SlowTrainer(FakeTrainer):
        def train_rollout(self, batch, step):
            time.sleep(0.5)  # the next step's rollout asks meanwhile
            return super().train_rollout(batch, step)

    pool, asked, calls = Pool(), [], []

    class Client(FakeClient):
        def generate_groups(self, prompts, group_size, sampling, **kw):
            calls.append(threading.current_thread() is threading.main_thread())
            if len(calls) == 2:  # step 2's rollout, on the producer thread, during training
                time.sleep(0.2)
                asked.append(pool.channel.run(timeout_s=30))
            return super().generate_groups(prompts, group_size, sampling, **kw)

    made = init_world_of_one()
    try:
        pusher = Pusher()
        ctx = loop_context(tmp_path, steps=2, client=Client(), pusher=pusher, servers=pool)
        ctx.cfg = config_from_dict({
            "gspo": {"group_size": 4}, "rollout": {"async": "one_step"},
            "run": {"num_steps": 2, "global_batch_size": 8, "micro_batch_size": 4,
                    "seq_length": 16, "eval_interval": 0, "save_interval": 0}})
        assert loop.run(ctx, SlowTrainer(), start_step=0)["status"] == "finished"
        ctx.logger.close()
    finally:
        if made:
            dist.destroy_process_group()
    assert calls == [False, False] and asked == [True]
    # the initial sync; the resync of step 2's rollout, off the main thread, with the weights of
    # step 1; the syncs after steps 1 and 2
    assert pusher.pushes == [("0", True), ("1", False), ("1", True), ("2", True)]


def test_router_and_server_logs_rotate_at_their_bound(cluster):
    for _ in range(6):
        generate(cluster, 16)
    for name in ("router", "server0", "server1"):
        sizes = _log_sizes(cluster, name)
        assert 1 <= len(sizes) <= 3, sizes
        assert all(size <= LOG_MAX for size in sizes.values()), sizes
    assert len(_log_sizes(cluster, "router")) >= 2  # it did rotate (the router logs every request)


def _log_sizes(cluster, name: str) -> dict:
    """``{path: size}`` of ``name``'s log files, read as one snapshot: the processes keep logging
    (the router logs its health checks) and a rotation between the listing and a ``stat`` renames
    a listed file, so a listing whose file vanished is taken again (at most 5 times)."""
    for _ in range(5):
        try:
            return {p: p.stat().st_size for p in cluster.log_paths(name)}
        except FileNotFoundError:
            continue
    raise AssertionError(f"{name}'s logs kept rotating under every listing")


def test_the_loop_syncs_the_pools_members_and_logs_the_event(tmp_path):
    """The loop's side: before each sync the pool's members go to the pusher; a push that fails
    because a server died meanwhile is made again once the pool has restarted it (same URL, a
    new process: ``renewed``); restarted servers are admitted after the sync; both counts are
    logged every step."""
    from types import SimpleNamespace

    from pipeline.weights.push import WeightPushError

    class Pool:
        def __init__(self):
            self.checks, self.admits, self.restarts, self.events = 0, 0, 0, 0

        def check(self):
            self.checks += 1
            if self.checks == 3:  # after the failed push of step 1: b died, was restarted
                self.restarts, self.events = 1, 2
            return ["http://a", "http://b"]

        def take_renewed(self):
            return ["http://b"] if self.checks == 3 else []

        def admit(self):
            self.admits += 1
            return []

        def readmitted(self):  # the router routes to every server at once
            return 0.0

        def metrics(self):
            return {"rollout/servers_alive": 2.0, "rollout/server_restarts": float(self.restarts)}

    class Pusher:
        def __init__(self):
            self.calls = []

        def set_servers(self, urls, *, renewed=()):
            self.calls.append(("set", list(urls), list(renewed)))

        def push(self, buckets, version):
            self.calls.append(("push", version))
            if self.calls.count(("push", "1")) == 1 and version == "1":
                raise WeightPushError("http://b: connection refused")
            return SimpleNamespace(metrics=dict)

    made = init_world_of_one()
    try:
        pool, pusher = Pool(), Pusher()
        ctx = loop_context(tmp_path, steps=2, pusher=pusher, servers=pool)
        loop.run(ctx, FakeTrainer(), start_step=0)
        ctx.logger.close()
    finally:
        if made:
            dist.destroy_process_group()
    both = ["http://a", "http://b"]
    assert pusher.calls == [("set", both, []), ("push", "0"),
                            ("set", both, []), ("push", "1"),  # b dies during this push
                            ("set", both, ["http://b"]), ("push", "1"),  # b restarted: again
                            ("set", both, []), ("push", "2")]
    assert pool.admits == 3  # after each successful sync
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout/servers_alive"], r["rollout/server_restarts"]) for r in records] == \
        [(2.0, 1.0), (2.0, 1.0)]


class TensorStream:
    """A bucket stream (``megatron_gspo.hf.gather.BucketStream``'s interface) of given HF
    tensors on a world of one, for the real ``WeightPusher`` without Megatron."""

    def __init__(self, tensors: dict, per_bucket: int = 8):
        import torch

        from megatron_gspo.hf.gather import Bucket

        names = sorted(tensors)
        groups = [names[i:i + per_bucket] for i in range(0, len(names), per_bucket)]
        self.count = len(groups)
        self.meta = [Bucket(index=i, count=self.count, source=0, names=g,
                            shapes=[tuple(tensors[n].shape) for n in g], dtype=torch.float32)
                     for i, g in enumerate(groups)]
        self._flats = [torch.cat([tensors[n].contiguous().reshape(-1).view(torch.uint8)
                                  for n in g]) for g in groups]
        self.sources, self.num_tensors = [0], len(names)
        self.total_bytes = sum(f.numel() for f in self._flats)
        self.dtype, self.seconds_waited = torch.float32, 0.0

    def __len__(self):
        return self.count

    def __iter__(self):
        from dataclasses import replace

        for meta, flat in zip(self.meta, self._flats):
            yield replace(meta, flat=flat)


def test_distributed_sync_reaches_a_restarted_server_through_new_groups(cluster):
    """The real WeightPusher (``distributed``: a gloo broadcast group with both servers): after
    server 1 is killed and restarted on its port, the next push makes the update groups again
    and both servers hold exactly the pushed weights (checksums verified per bucket)."""
    import torch
    from safetensors.torch import load_file

    from pipeline.weights.push import WeightPusher
    from pipeline.weights.transport import weights_checksum

    base = load_file(str(Path(cluster.model_path) / "model.safetensors"))
    made = init_world_of_one()
    pusher = WeightPusher(cluster.server_urls, transport="distributed", verify=True)
    try:
        pool = ServerPool(cluster.server_urls, router_url=cluster.router_url, cluster=cluster)
        for version, kill in (("1", False), ("2", True)):
            if kill:
                cluster.kill_server(1)
            members = pool.check()
            pusher.set_servers(members, renewed=pool.take_renewed())
            gen = torch.Generator().manual_seed(int(version))
            weights = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
            stats = pusher.push(TensorStream(weights), version)
            assert stats.verified_buckets == stats.num_buckets > 1
            pool.admit()
            for url in members:
                got = http_json("POST", url + "/weights_checker", {"action": "checksum"})[1]
                assert got["checksum"] == weights_checksum(weights.items()), (version, url)
                info = http_json("GET", url + "/model_info")[1]  # SGLang: the live version
                assert info["weight_version"] == version
        assert pool.restarts == 1 and router_urls(cluster) == set(members)
    finally:
        pusher.close()
        if made:
            dist.destroy_process_group()


def test_rotating_log_bounds_a_childs_output(tmp_path):
    path = tmp_path / "child.log"
    log = RotatingLog(path, max_bytes=64 << 10, backups=2)
    log.write(b"$ header\n")
    code = "import sys\nfor i in range(100000): sys.stdout.write(f'line {i:06d}\\n')"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=log.fd,
                            stderr=subprocess.STDOUT)
    log.started()
    assert proc.wait(60) == 0
    log.close()
    files = [path.with_name(f"child.log.{i}") for i in (2, 1)] + [path]
    assert all(f.exists() for f in files) and not path.with_name("child.log.3").exists()
    assert all(f.stat().st_size <= 64 << 10 for f in files)
    text = b"".join(f.read_bytes() for f in files).decode()
    lines = text.splitlines()
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers[-1] == 99999 and numbers == list(range(numbers[0], 100000))  # whole, in order
    assert all(f.stat().st_size > (64 << 10) - 12 for f in files[:2])  # rotated when full


def _server_pids(run: Run) -> list[int]:
    """The run's local rollout servers (``python -m pipeline.local`` processes)."""
    return [p for p in tagged_pids(run.tag)
            if b"pipeline.local" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]


@pytest.mark.slow
@pytest.mark.extended  # the README suite's time; the mid-rollout death below stays in it
def test_train_survives_a_killed_server(tmp_path, sft_policy):
    run_dir = tmp_path / "run"
    run = Run(train_args(run_dir, f"run.init_from={sft_policy}", "rollout.num_servers=2",
                         "run.num_steps=4", "run.save_interval=0"), tmp_path / "train.log")
    try:
        run.wait_until(lambda: 1 in metric_steps(run_dir), "step 1", timeout=900)
        servers = _server_pids(run)
        assert len(servers) == 2, servers
        os.kill(servers[1], signal.SIGKILL)
        code = run.wait(timeout=900)
    finally:
        run.kill_everything()
    out = run.output()
    assert code == 0, out[-4000:]
    assert "restarting it" in out and "back in the router" in out, out[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["rollout/server_restarts"] == 1.0
    assert records[-1]["rollout/servers_alive"] == 2.0


def _kill_the_only_server_after_step_1(tmp_path, *settings: str) -> tuple[int, str, list[dict]]:
    """A run with one embedded server, SIGKILLed as soon as step 1 is logged (step 2's rollout
    starts right after that line); (exit status, output, metrics records)."""
    run_dir = tmp_path / "run"
    run = Run(train_args(run_dir, "run.save_interval=0", *settings), tmp_path / "train.log")
    try:
        run.wait_until(lambda: bool(tagged_pids(run.tag)), "the launcher", timeout=60)
        deadline = time.monotonic() + 600
        while 1 not in metric_steps(run_dir):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.output()[-4000:]
            time.sleep(0.02)
        servers = _server_pids(run)
        assert len(servers) == 1, servers
        os.kill(servers[0], signal.SIGKILL)
        code = run.wait(timeout=600)
    finally:
        run.kill_everything()
    out = run.output()
    records = ([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
               if code == 0 else [])
    return code, out, records


@pytest.mark.slow
def test_train_survives_its_only_server_dying_mid_rollout(tmp_path):
    """Issue 22 item 5: one embedded server, SIGKILLed as step 2's rollout begins: the rollout
    waits, the server is restarted and synced to the current weights mid-rollout (every rank
    takes part), the batch completes and the run finishes (exit 0) instead of ending with the
    router's ``503 No available workers``."""
    code, out, records = _kill_the_only_server_after_step_1(tmp_path, "run.num_steps=3")
    assert code == 0, out[-4000:]
    assert "no live server" in out and "the rollout resumes its unfinished requests" in out, \
        out[-4000:]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1]["rollout/server_restarts"] == 1.0
    assert records[1]["rollout/requests_retried"] >= 1
    assert records[-1]["rollout/servers_alive"] == 1.0


@pytest.mark.parametrize("mode", ["one_step", "full"])
def test_train_survives_its_only_server_dying_in_an_async_mode(tmp_path, mode):
    """Issue 38 item 2: ``rollout.async: one_step`` / ``full``, one embedded server SIGKILLed
    after step 1 (the next rollout under way, or the stream generating while the trainer
    trains): the server is restarted and synced to the current weights, its samples in flight
    are generated again, and the run finishes (exit 0) instead of stopping after
    ``rollout.outage_timeout_s`` with ``no live server ... waiting for a weight sync``. The
    rollout runs in the producer process (issue 37 item 6): its client's wait for a live server
    is the pool's on rank 0, whose resync has every rank take part."""
    code, out, records = _kill_the_only_server_after_step_1(tmp_path, "run.num_steps=4",
                                                             f"rollout.async={mode}")
    assert code == 0, out[-4000:]
    assert "no live server" in out, out[-4000:]
    # the rollout ran in the producer process; the pool it asked, and the sync, on rank 0
    assert "rollout producer: process" in out and f"(rollout.async: {mode})" in out
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["rollout/server_restarts"] == 1.0
    assert records[-1]["rollout/servers_alive"] == 1.0
