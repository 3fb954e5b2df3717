"""The client with the real sglang-router and two local rollout servers (subprocesses).

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_cluster.py``

``LocalRolloutCluster`` starts two ``megatron-gspo serve`` processes and sglang-router 0.3.2 with
its own CLI, registering the servers through ``POST /workers``. Checked: groups complete whole
through the router; a server SIGKILLed mid-batch loses nothing and duplicates nothing; the
restarted server rejoins the router and serves again; direct mode skips a dead server; a request
that times out is aborted on its server; over-sampling returns only complete groups and leaves
the servers idle; routed experts reach a client in router mode although the router drops the
request field.
"""

from __future__ import annotations

import threading
import time

import pytest

from pipeline.generation.client import RolloutClient, RolloutError, SamplingParams, http_json
from pipeline.servers.cluster import LocalRolloutCluster, free_port

GROUP = 4


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    # round_robin: both servers get work, so the restarted one provably serves again. Eight
    # running requests per server make groups finish in waves (over-sampling has work to abort).
    with LocalRolloutCluster(model_dir, 2, log_dir=tmp_path_factory.mktemp("cluster_logs"),
                             router_policy="round_robin",
                             server_args=["--max-running-requests", "8",
                                          "--enable-return-routed-experts"]) as c:
        yield c


def prompts(n: int) -> list[list[int]]:
    return [[5 + i, 6, 7 + (i % 3)] for i in range(n)]


def check_whole(groups, expected_prompts, group_size=GROUP):
    assert len(groups) == len(expected_prompts)
    rids = [r.rid for g in groups for r in g]
    assert len(rids) == len(set(rids)) == len(expected_prompts) * group_size
    for g, p in zip(groups, expected_prompts):
        assert len(g) == group_size
        for r in g:
            assert r.prompt_ids == p and r.finish_reason in ("stop", "length")
            assert len(r.output_logprobs) == len(r.output_ids) == r.completion_tokens > 0


def finished(url: str) -> int:
    return http_json("GET", url + "/server_info")[1]["internal_states"][0]["num_finished_reqs"]


def outputs(groups):
    return [[r.output_ids for r in g] for g in groups]


def assert_same_samples(a, b):
    """Seeded samples repeat whichever server answers, up to fp32 rounding: a different batch
    composition perturbs logits by ~1e-6, which can move a draw across a CDF boundary (rarely)."""
    pairs = [(x, y) for ga, gb in zip(outputs(a), outputs(b)) for x, y in zip(ga, gb)]
    same = sum(x == y for x, y in pairs)
    assert same >= 0.9 * len(pairs), f"only {same} of {len(pairs)} samples repeated"


def test_groups_complete_through_the_router(cluster):
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60)
    before = [finished(u) for u in cluster.server_urls]
    groups = client.generate_groups(prompts(8), GROUP, SamplingParams(max_new_tokens=16), seed=1)
    check_whole(groups, prompts(8))
    assert all(finished(u) > b for u, b in zip(cluster.server_urls, before))  # both served
    seeds_differ = {tuple(r.output_ids) for r in groups[0]}
    assert len(seeds_differ) > 1  # G samples of a prompt differ (distinct sampling seeds)
    again = client.generate_groups(prompts(8), GROUP, SamplingParams(max_new_tokens=16), seed=1)
    assert_same_samples(again, groups)  # seeded: whichever server answers


def test_the_servers_it_starts_answer_health_while_paused(cluster):
    """Issue 37 item 1: the launcher starts its servers with SGLANG_ENABLE_HEALTH_ENDPOINT_
    GENERATION=false, so /health answers at once while a weight sync pauses them (the router's
    checks keep passing); /health_generate still generates, and that waits while paused."""
    url = cluster.server_urls[0]
    assert http_json("POST", url + "/pause_generation", {"mode": "abort"})[0] == 200
    try:
        t0 = time.monotonic()
        assert http_json("GET", url + "/health", timeout_s=5)[0] == 200
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(RolloutError, match="timed out"):
            http_json("GET", url + "/health_generate", timeout_s=0.5)
    finally:
        assert http_json("POST", url + "/continue_generation", {})[0] == 200
    assert http_json("GET", url + "/health_generate", timeout_s=10)[0] == 200


def test_routed_experts_bypass_the_router_that_drops_the_field(cluster):
    body = {"input_ids": [5, 6, 7], "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 3}}
    direct = http_json("POST", cluster.server_urls[0] + "/generate", body)[1]
    assert "routed_experts" in direct["meta_info"]
    via_router = http_json("POST", cluster.router_url + "/generate", body)[1]
    assert "routed_experts" not in via_router["meta_info"]  # sglang-router 0.3.2 drops it
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60)
    groups = client.generate_groups(prompts(4), 2, SamplingParams(max_new_tokens=8), seed=6,
                                    routed_experts=(2, 2))  # tests/rollout/tiny.py: 2 layers, top-2
    check_whole(groups, prompts(4), group_size=2)
    for r in (r for g in groups for r in g):
        assert r.server_url in cluster.server_urls  # straight to a worker
        assert r.routed_experts.shape == (len(r.prompt_ids) + len(r.output_ids) - 1, 2, 2)
        assert bool(((r.routed_experts >= 0) & (r.routed_experts < 4)).all())


def test_killed_server_loses_nothing_and_the_restarted_one_rejoins(cluster):
    client = RolloutClient(router_url=cluster.router_url, request_timeout_s=60)
    sampling = SamplingParams(max_new_tokens=80)
    victim = cluster.server_urls[1]
    killed = threading.Event()

    def kill_when_busy():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            load = http_json("GET", victim + "/v1/loads")[1]["loads"][0]
            if load["num_running_reqs"] > 0 and finished(victim) > 0:
                cluster.kill_server(1)  # SIGKILL: dies mid-request
                killed.set()
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    groups = client.generate_groups(prompts(8), GROUP, sampling, seed=2)
    killer.join()
    assert killed.is_set() and not cluster.server_alive(1)
    check_whole(groups, prompts(8))

    cluster.restart_server(1)
    workers = {w["url"]: w for w in
               http_json("GET", cluster.router_url + "/workers")[1]["workers"]}
    assert workers[victim]["is_healthy"] and len(workers) == 2
    served = finished(victim)
    again = client.generate_groups(prompts(8), GROUP, sampling, seed=2)
    assert_same_samples(again, groups)  # the retried samples are the same samples
    assert finished(victim) > served  # the restarted server serves again


def test_direct_mode_skips_a_dead_server(cluster):
    dead = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient(server_urls=[dead, *cluster.server_urls], request_timeout_s=60,
                           retry_backoff_s=0.05)
    groups = client.generate_groups(prompts(4), GROUP, SamplingParams(max_new_tokens=8), seed=3)
    check_whole(groups, prompts(4))
    assert {r.server_url for g in groups for r in g} <= set(cluster.server_urls)


def test_over_sampling_keeps_complete_groups_and_aborts_the_rest(cluster):
    client = RolloutClient(server_urls=cluster.server_urls, request_timeout_s=60)
    many = prompts(16)
    groups = client.generate_groups(many, GROUP, SamplingParams(max_new_tokens=200), seed=4,
                                    min_complete_groups=2)
    assert 2 <= len(groups) < len(many)
    for g in groups:
        assert len(g) == GROUP and all(r.finish_reason != "abort" for r in g)
        assert all(r.prompt_ids == g[0].prompt_ids for r in g)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # nothing keeps running on the servers
        loads = [http_json("GET", u + "/v1/loads")[1]["loads"][0] for u in cluster.server_urls]
        if all(l["num_running_reqs"] == 0 and l["num_waiting_reqs"] == 0 for l in loads):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"servers still busy after over-sampling: {loads}")


def test_timeouts_and_dead_routers_are_bounded_and_named(cluster):
    url = cluster.server_urls[0]
    client = RolloutClient(server_urls=[url], request_timeout_s=0.3, max_attempts=2,
                           retry_backoff_s=0.05)
    # A paused server holds new generates: the request cannot answer in time.
    assert http_json("POST", url + "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        with pytest.raises(RolloutError) as err:
            client.generate_sync([("slow", [5], SamplingParams(max_new_tokens=240))])
    finally:
        assert http_json("POST", url + "/continue_generation", {})[0] == 200
    assert err.value.url == url and "no answer within 0.3 s" in err.value.message
    deadline = time.monotonic() + 10  # the abandoned attempts do not keep running there
    while any(http_json("GET", url + "/v1/loads")[1]["loads"][0][k]
              for k in ("num_running_reqs", "num_waiting_reqs")):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    dead_router = f"http://127.0.0.1:{free_port()}"
    client = RolloutClient(router_url=dead_router, max_attempts=2, retry_backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(RolloutError) as err:
        client.generate_sync([("r", [5], SamplingParams(max_new_tokens=2))])
    assert err.value.url == dead_router and "gave up after 2 attempts" in str(err.value)
    assert time.monotonic() - start < 10
