"""Issue 11, item 4 (and the log half of item 8): a rollout server that dies does not end the run.

The probe SIGKILLed one of two embedded servers: the router routed generation around it, but the
next weight sync failed and ended the run; nothing restarted it. Here:

* ``ServerPool`` with the real sglang-router and two real ``megatron-gspo serve`` processes: a
  killed server is taken out of the router, restarted on its port, kept out of the router until
  :meth:`admit` (after the sync that gives it the current weights), and the router only ever
  routes to servers that hold them; below ``min_servers`` (a restart that fails) the error
  names the server and why; the servers' and the router's logs rotate at their size bound;
* the GSPO loop (``pipeline.loop.run``, stand-in trainer) pushes to the pool's members and logs
  ``rollout/servers_alive`` and ``rollout/server_restarts``;
* ``RotatingLog`` on its own: a child writing 1 MB leaves at most (backups + 1) files of at most
  max_bytes each, whole lines, the newest output kept;
* slow: ``megatron-gspo train`` (2 ranks, 2 embedded servers, the disk weight sync), one server
  SIGKILLed after step 1: the run finishes, exit 0, with one restart logged and both servers
  serving at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from pipeline import loop
from pipeline.rollout import RolloutClient, SamplingParams, http_json
from pipeline.server_pool import ServerPool, ServerPoolError
from pipeline.servers import LocalRolloutCluster, RotatingLog
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
    assert pool.metrics() == {"rollout/servers_alive": 2.0, "rollout/server_restarts": 0.0}
    old_pid = cluster._procs["server1"].pid
    cluster.kill_server(1)  # SIGKILL, as a crash or the OOM killer would
    members = pool.check()
    assert members == urls  # server 1 restarted: it is in the next sync
    assert pool.take_renewed() == [urls[1]]  # a new process: its update groups are made again
    assert cluster.server_alive(1) and cluster._procs["server1"].pid != old_pid
    assert router_urls(cluster) == {urls[0]}  # ... but not in the router before that sync
    assert pool.metrics() == {"rollout/servers_alive": 1.0, "rollout/server_restarts": 1.0}
    before = [finished(u) for u in urls]
    generate(cluster)
    after = [finished(u) for u in urls]
    assert after[0] > before[0] and after[1] == before[1]  # nothing reached the pending server
    assert pool.admit() == [urls[1]]  # the sync went through: back in the router
    assert router_urls(cluster) == set(urls)
    assert pool.metrics() == {"rollout/servers_alive": 2.0, "rollout/server_restarts": 1.0}
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


def test_router_and_server_logs_rotate_at_their_bound(cluster):
    for _ in range(6):
        generate(cluster, 16)
    for name in ("router", "server0", "server1"):
        paths = cluster.log_paths(name)
        assert 1 <= len(paths) <= 3, paths
        assert all(p.stat().st_size <= LOG_MAX for p in paths), [p.stat().st_size for p in paths]
    assert len(cluster.log_paths("router")) >= 2  # it did rotate (the router logs every request)


def test_the_loop_syncs_the_pools_members_and_logs_the_event(tmp_path):
    """The loop's side: before each sync the pool's members go to the pusher; a push that fails
    because a server died meanwhile is made again once the pool has restarted it (same URL, a
    new process: ``renewed``); restarted servers are admitted after the sync; both counts are
    logged every step."""
    from types import SimpleNamespace

    from pipeline.weight_push import WeightPushError

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

    from pipeline.weight_push import WeightPusher
    from pipeline.weight_transport import weights_checksum

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


@pytest.mark.slow
def test_train_survives_a_killed_server(tmp_path, sft_policy):
    run_dir = tmp_path / "run"
    run = Run(train_args(run_dir, f"run.init_from={sft_policy}", "rollout.num_servers=2",
                         "run.num_steps=4", "run.save_interval=0"), tmp_path / "train.log")
    try:
        run.wait_until(lambda: 1 in metric_steps(run_dir), "step 1", timeout=900)
        servers = [p for p in tagged_pids(run.tag)
                   if b"serve" in Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")]
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
