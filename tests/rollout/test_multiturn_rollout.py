"""Multi-turn trajectories against the project's rollout server (SGLang's protocol), token in /
token out.

Run: ``.venv/bin/python -m pytest -q tests/rollout/test_multiturn_rollout.py``

Two in-process servers on a Qwen3-MoE with 16 experts top-4 (routes differ between tokens), with
their prefix caches and routed experts on, and a cold reference server (no prefix cache). An
environment answers every turn with text of its own for three turns. Checked:

* token equality: the trajectory's tokens - and the training row ``rl_batch`` builds from them -
  are, token for token, the prompt, then what the server returned for each turn (recorded off
  the wire), then the environment's text as tokenized when it was appended; each turn's request is
  exactly the trajectory so far; the loss mask is 1 on the server's tokens and 0 elsewhere;
* the server's per-turn log-probs are the log-probs of those tokens in the whole trajectory: the
  cold server, given the full trajectory as ONE prompt, scores the model's tokens as the turns
  did (1e-4);
* sticky sessions: every turn goes to the trajectory's server, and from the second turn on its
  prefix cache serves the previous turn's prompt and output (``cached_tokens`` per turn =
  previous request + its output - 1);
* routing replay ``rollout``: the trajectory's routes, composed from its turns, equal the routes
  of the single-turn equivalent (the whole trajectory prefilled at once on the cold server), and
  so do the replay rows of the training batch;
* a weight update while a tool call is in flight (the asynchronous modes push weights whenever a
  step ends): the next turn runs on the new weights from a flushed cache, the trajectory's
  ``weight_versions`` spans name each turn's version at its offsets (the tool's tokens in no
  span), and each turn's log-probs are those of its own weights.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from megatron_gspo.train.batching import rl_batch
from pipeline.generation import routed_experts as rx
from pipeline.scoring.data import Prompt
from pipeline.generation.environment import EnvStep
from pipeline.generation.multiturn import Budgets, generate_trajectory_groups, run_trajectory
from pipeline.generation.client import RolloutClient, SamplingParams, http_json
from tests.rollout.conftest import InProcessServer

NUM_LAYERS, NUM_EXPERTS, TOP_K = 3, 16, 4
TURNS = 3


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tests.rollout.tiny import make_model_dir

    shape = dict(num_layers=NUM_LAYERS, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    directory = make_model_dir(tmp_path_factory.mktemp("multiturn") / "moe16", seed=7, **shape)
    make_model_dir(directory.parent / "moe16_v1", seed=8, **shape)  # the weights of version "1"
    return directory


@pytest.fixture(scope="module")
def tokenizer(moe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(moe_dir), local_files_only=True)


@pytest.fixture(scope="module")
def servers(moe_dir):
    """(two servers with prefix caches, a cold reference), routed experts on every one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    roots = [str(moe_dir.parent)]  # the second weights (moe16_v1) may be loaded
    hot = [InProcessServer(moe_dir, enable_return_routed_experts=True, weight_roots=roots)
           for _ in range(2)]
    cold = InProcessServer(moe_dir, enable_return_routed_experts=True, disable_radix_cache=True,
                           weight_roots=roots)
    yield hot, cold
    for s in (*hot, cold):
        s.close()
    torch.set_num_threads(threads)


class Answering:
    """An environment (``pipeline.generation.environment.Environment``) that answers turn k with "=k?" plus
    a few letters, and ends the trajectory after ``TURNS`` model turns."""

    def __init__(self):
        self.turn = 0
        self.observations: list[str] = []

    def reset(self, prompt: Prompt) -> list[int]:
        self.turn = 0
        return list(prompt.prompt_ids)

    def step(self, text: str, *, tool_time_left_s: float) -> EnvStep:
        self.turn += 1
        if self.turn >= TURNS:
            return EnvStep(done=True, end_reason="done", reward=float(len(text) % 2))
        obs = f"={self.turn}?" + "abcxyz"[:self.turn + 2]
        self.observations.append(obs)
        return EnvStep(observation=obs, tool_calls=1)


def prompt_of(tokenizer, text: str, index: int = 0) -> Prompt:
    return Prompt(index=index, prompt_ids=tokenizer.encode(text), label=None, text=text,
                  origin="test")


def encode_text(tokenizer):
    return lambda s: tokenizer.encode(s)


async def recorded_trajectory(hot, tokenizer, env, text, sampling, max_tool_time_s, *, rid,
                              wire, **kw):
    """One trajectory on the ``hot`` servers whose every request and response is appended to
    ``wire`` as (request ids, response)."""
    client = RolloutClient(server_urls=[s.url for s in hot])
    async with client.session() as send:
        async def recording(rid, ids, sampling, **kw):
            r = await send(rid, ids, sampling, **kw)
            wire.append((list(ids), r))
            return r
        return await run_trajectory(
            recording, env, prompt_of(tokenizer, text), sampling,
            Budgets(max_turns=TURNS, max_tokens=None, max_tool_time_s=max_tool_time_s,
                    fit_length=200),
            rid=rid, encode_text=encode_text(tokenizer), decode=tokenizer.decode,
            pin=client.pick_server(), **kw)


def trajectory(servers, tokenizer, text="12+34=", seed=3):
    """One trajectory through a recording sender: (result, [(request ids, response)], env)."""
    hot, _ = servers
    env = Answering()
    wire = []
    r = asyncio.run(recorded_trajectory(
        hot, tokenizer, env, text,
        SamplingParams(max_new_tokens=12, sampling_seed=seed, temperature=1.0), 1.0,
        rid=f"traj{seed}", wire=wire, routed_experts=(NUM_LAYERS, TOP_K)))
    return r, wire, env


def test_trained_tokens_are_the_servers_tokens_and_the_appended_ones(servers, tokenizer):
    r, wire, env = trajectory(servers, tokenizer)
    assert r.end_reason == "done" and len(wire) == TURNS and len(r.turns) == TURNS
    prompt = tokenizer.encode("12+34=")
    expected, mask = list(prompt), []
    for k, (request, response) in enumerate(wire):
        assert request == expected  # token in: the trajectory so far, never re-rendered
        assert len(response.output_ids) >= 1
        expected += response.output_ids
        mask += [1] * len(response.output_ids)
        if k < TURNS - 1:
            obs = tokenizer.encode(env.observations[k])
            expected += obs
            mask += [0] * len(obs)
    assert r.prompt_ids + r.output_ids == expected
    assert r.output_mask == mask
    model_lps = [lp for lp, m in zip(r.output_logprobs, r.output_mask) if m]
    assert model_lps == [lp for _, resp in wire for lp in resp.output_logprobs]
    assert all(lp == 0.0 for lp, m in zip(r.output_logprobs, r.output_mask) if not m)
    # the training row: tokens = prompt + output, the loss mask on the server's tokens only
    seq = 200
    batch = rl_batch([r.prompt_ids], [r.output_ids], [r.output_logprobs], torch.zeros(1), seq, 0,
                     output_masks=[r.output_mask])
    row = batch["tokens"][0].tolist() + [batch["labels"][0, -1].item()]
    assert row[:len(expected)] == expected
    labels = batch["labels"][0]
    trained = labels[batch["response_mask"][0]].tolist()
    assert trained == [t for _, resp in wire for t in resp.output_ids]
    assert batch["rollout_log_probs"][0][batch["response_mask"][0]].tolist() == pytest.approx(
        model_lps, abs=1e-6)


def cold_prefill(servers, ids: list[int], **fields) -> dict:
    """``meta_info`` of a prefill of ``ids`` on the cold reference server (no new token)."""
    _, cold = servers
    status, answer = http_json("POST", cold.url + "/generate", {
        "input_ids": ids, **fields, "sampling_params": {"max_new_tokens": 0}})
    assert status == 200, answer
    return answer["meta_info"]


def test_per_turn_log_probs_are_those_of_the_whole_trajectory(servers, tokenizer):
    r, _, _ = trajectory(servers, tokenizer, seed=5)
    ids = r.prompt_ids + r.output_ids
    scored = cold_prefill(servers, ids, return_logprob=True,
                          logprob_start_len=0)["input_token_logprobs"]  # [lp, token, None] per input token
    assert [t for _, t, _ in scored] == ids
    p = len(r.prompt_ids)
    for j, (m, lp) in enumerate(zip(r.output_mask, r.output_logprobs)):
        if m:
            assert scored[p + j][0] == pytest.approx(lp, abs=1e-4), j


def test_turns_stay_on_one_server_and_its_prefix_cache_serves_the_earlier_turns(servers,
                                                                                 tokenizer):
    r, wire, _ = trajectory(servers, tokenizer, seed=8)
    assert len({resp.server_url for _, resp in wire}) == 1
    for k in range(1, TURNS):
        previous_request, previous = wire[k - 1]
        assert r.turns[k].cached_tokens == wire[k][1].cached_tokens
        assert wire[k][1].cached_tokens == len(previous_request) + len(previous.output_ids) - 1
    assert r.cached_tokens == sum(resp.cached_tokens for _, resp in wire)


def test_groups_of_trajectories_are_sticky_and_reproducible(servers, tokenizer):
    hot, _ = servers
    client = RolloutClient(server_urls=[s.url for s in hot])
    prompts = [prompt_of(tokenizer, t, i) for i, t in enumerate(["1+2=", "33+4=", "5+67="])]
    budgets = Budgets(max_turns=TURNS, max_tokens=None, max_tool_time_s=1.0, fit_length=200)

    def run():
        return asyncio.run(generate_trajectory_groups(
            client, prompts, 2, SamplingParams(max_new_tokens=10), make_env=Answering,
            budgets=budgets, encode_text=encode_text(tokenizer), decode=tokenizer.decode, seed=11,
            routed_experts=(NUM_LAYERS, TOP_K)))
    first, again = run(), run()
    flat = [x for g in first for x in g]
    assert [len(g) for g in first] == [2, 2, 2]
    assert all(len({t.server_url for t in x.turns}) == 1 for x in flat)
    assert len({x.turns[0].server_url for x in flat}) == 2  # both servers used
    assert all(t.cached_tokens > 0 for x in flat for t in x.turns[1:])
    # seeded: the same trajectories again (wherever each one ran)
    assert [x.output_ids for x in flat] == [x.output_ids for g in again for x in g]
    assert all(x.routed_experts.shape == (len(x.prompt_ids) + len(x.output_ids) - 1, NUM_LAYERS,
                                          TOP_K) for x in flat)


def test_per_turn_routes_equal_the_single_turn_equivalents(servers, tokenizer):
    r, _, _ = trajectory(servers, tokenizer, seed=13)
    ids = r.prompt_ids + r.output_ids
    meta = cold_prefill(servers, ids, return_routed_experts=True, routed_experts_start_len=0)
    single = rx.decode(meta["routed_experts"], len(ids) - 1, NUM_LAYERS, TOP_K)
    assert r.routed_experts.shape == single.shape
    assert torch.equal(r.routed_experts, single)
    # the trainer's replay rows of the multi-turn sample and of the single-turn one are equal
    seq = 200
    multi = rx.batch_routed_experts([r.prompt_ids], [r.output_ids], [r.routed_experts], seq,
                                    NUM_LAYERS, TOP_K)
    flat = rx.batch_routed_experts([ids[:-1]], [ids[-1:]], [single], seq, NUM_LAYERS, TOP_K)
    assert torch.equal(multi, flat)
    assert (multi[0, :len(ids) - 1] >= 0).all() and (multi[0, len(ids) - 1:] == rx.UNKNOWN).all()


class ToolInFlight(Answering):
    """Turn 0's "tool call" waits until ``release`` is set (``busy`` says it started)."""

    def __init__(self):
        super().__init__()
        self.busy, self.release = threading.Event(), threading.Event()

    def step(self, text, *, tool_time_left_s):
        if self.turn == 0:
            self.busy.set()
            assert self.release.wait(60)
        return super().step(text, tool_time_left_s=tool_time_left_s)


def load_weights(server, path, version: str) -> None:
    status, answer = http_json("POST", server.url + "/update_weights_from_disk",
                               {"model_path": str(path), "weight_version": version})
    assert status == 200 and answer["success"], answer


def score(server, ids):
    status, answer = http_json("POST", server.url + "/generate", {
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 0}})
    assert status == 200, answer
    return [lp for lp, _, _ in answer["meta_info"]["input_token_logprobs"]]


def test_a_weight_update_during_a_tool_call_keeps_the_trajectory_right(servers, tokenizer,
                                                                        moe_dir):
    hot, cold = servers
    env = ToolInFlight()
    wire, out = [], {}
    go = recorded_trajectory(hot, tokenizer, env, "7+8=",
                             SamplingParams(max_new_tokens=10, sampling_seed=21), 60.0,
                             rid="inflight", wire=wire)
    worker = threading.Thread(target=lambda: out.setdefault("r", asyncio.run(go)))
    worker.start()
    old_version = None
    try:
        assert env.busy.wait(60)
        old_version = wire[0][1].weight_version
        for server in hot:  # the trainer's push, while the tool runs
            load_weights(server, moe_dir.parent / "moe16_v1", "1")
        env.release.set()
        worker.join(60)
        r = out["r"]
        assert r.end_reason == "done" and len(r.turns) == TURNS
        t = r.turns
        assert r.weight_versions == [(old_version, 0, t[0].length)] + [
            (1, t[k].start, t[k].start + t[k].length) for k in range(1, TURNS)]
        assert old_version != 1
        assert t[1].cached_tokens == 0 and t[2].cached_tokens > 0  # flushed by the push
        # each turn's log-probs are those of the weights it ran on
        ids, p = r.prompt_ids + r.output_ids, len(r.prompt_ids)
        load_weights(cold, moe_dir.parent / "moe16_v1", "1")
        new = score(cold, ids)
        load_weights(cold, moe_dir, "0")
        old = score(cold, ids)
        for k, turn in enumerate(t):
            ref = old if k == 0 else new
            other = new if k == 0 else old
            got = r.output_logprobs[turn.start:turn.start + turn.length]
            want = ref[p + turn.start:p + turn.start + turn.length]
            assert got == pytest.approx(want, abs=1e-4), k
            assert got != pytest.approx(other[p + turn.start:p + turn.start
                                              + turn.length], abs=1e-3)
    finally:
        env.release.set()
        worker.join(60)
        for server in hot:
            load_weights(server, moe_dir, "0")
