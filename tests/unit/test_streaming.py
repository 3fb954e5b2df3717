"""``rollout.async: full``'s rollout stream (pipeline/sources/stream.py) against a simulated server.

The simulated server generates each sample token by token, labelling every token with the weight
version it holds at that moment (what SGLang's ``meta_info.weight_versions`` reports for a request
retracted and continued across updates); the simulated trainer takes each step's batch, "trains"
for a while, then pushes (the server's version and the stream's move on together). Checked:
no trained sample is ever more than eta versions stale, nothing drawn is lost or trained twice,
aborted groups are generated again first, generation overlaps training, and a checkpoint of the
stream restores its complete groups exactly.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pipeline.scoring.data import Prompt
from pipeline.generation.trajectory import RolloutResult, Span, result_from_json, result_to_json
from pipeline.sources.stream import (RolloutStream, StreamCounts, admission_limit, difficulty,
                                oldest_version, step_metrics)

G = 2
P = 3


def spans_of(labels: list[int]) -> list[Span]:
    """Per-token versions -> SGLang's ``weight_versions`` spans (version, start, end)."""
    spans, start = [], 0
    for t in range(1, len(labels) + 1):
        if t == len(labels) or labels[t] != labels[start]:
            spans.append(Span(labels[start], start, t))
            start = t
    return spans


class Server:
    """A rollout server that holds one weight version at a time."""

    def __init__(self, token_s: float = 0.002, abort_first_try: frozenset = frozenset()):
        self.version = 0
        self.token_s = token_s
        self.abort_first_try = abort_first_try
        self.requests = 0

    def length(self, prompt_index: int) -> int:
        return 40 if prompt_index % 5 == 0 else 6  # every fifth prompt is long ("hard")

    async def generate(self, prompt, seed: int, rid: str) -> list[RolloutResult]:
        index, attempt = prompt.prompt_ids[0], int(rid.split("a")[-1])
        out = []
        for s in range(G):
            self.requests += 1
            labels = []
            for _ in range(self.length(index)):
                await asyncio.sleep(self.token_s)
                labels.append(self.version)
            spans = spans_of(labels)
            aborted = index in self.abort_first_try and attempt == 0 and s == 0
            out.append(RolloutResult(
                rid=f"{rid}-{s}", prompt_ids=list(prompt.prompt_ids), output_ids=[7] * len(labels),
                output_logprobs=[-0.5] * len(labels), finish_reason="abort" if aborted else "stop",
                matched_stop=None, prompt_tokens=len(prompt.prompt_ids), completion_tokens=len(labels),
                weight_version=labels[-1], server_url="sim", weight_versions=spans))
        return out


def make_stream(server: Server, eta: int, drawn: list, *, start: int = 0,
                timeout_s: float = 30.0, **stoppable) -> RolloutStream:
    def draw() -> Prompt:
        i = len(drawn)
        drawn.append(i)
        return Prompt(index=i, prompt_ids=[i, 1, 2], label=None, text=str(i), origin=f"sim#{i}")

    def score(prompt: Prompt, results: list) -> tuple[list[float], int]:
        return [float(prompt.index % 2), 1.0][:len(results)], 0

    return RolloutStream(generate=server.generate, score=score, draw=draw, prompts_per_step=P,
                         max_staleness=eta, version=start, taken=start,
                         seed_of=lambda i, a: 1000 * i + a, timeout_s=timeout_s, **stoppable)


def train(stream: RolloutStream, server: Server, steps: range, train_s: float = 0.03):
    """The loop's schedule: take, train, push; returns the groups trained at each step."""
    trained = {}
    for step in steps:
        trained[step] = stream.take(step)
        time.sleep(train_s)
        server.version = step
        stream.set_version(step)
    return trained


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_no_trained_sample_is_more_than_eta_versions_stale_and_nothing_is_lost(eta):
    server, drawn = Server(), []
    stream = make_stream(server, eta, drawn)
    stream.start()
    try:
        trained = train(stream, server, range(1, 9))
        state = stream.state(lambda: {"drawn": len(drawn)})
    finally:
        stream.close()
    ages = []
    for step, groups in trained.items():
        assert len(groups) == P
        for g in groups:
            for r in g.results:
                versions = [int(v) for v, a, b in r.weight_versions]
                ages.append(step - 1 - min(versions))
                assert step - 1 - min(versions) <= eta, (step, g.prompt.index, r.weight_versions)
    assert max(ages) == eta  # the bound is reached, not just respected (overlap happens)
    # nothing lost, nothing twice: every prompt drawn is trained once, buffered or pending
    trained_ids = [g.prompt.index for groups in trained.values() for g in groups]
    assert len(trained_ids) == len(set(trained_ids))
    kept = ([g["prompt"]["index"] for g in state["rollout_stream"]["complete"]]
            + [p["prompt"]["index"] for p in state["rollout_stream"]["pending"]])
    assert sorted(trained_ids + kept) == drawn
    assert stream.counts.dropped == 0
    if eta >= 1:  # partial rollouts: some samples were generated across a weight update
        assert sum(stream.counts.resumed.values()) > 0


def test_generation_overlaps_training_only_when_staleness_allows_it():
    busy = {}
    for eta in (0, 1):
        server, drawn = Server(), []
        stream = make_stream(server, eta, drawn)
        stream.start()
        try:
            stream.take(1)
            b0 = stream.busy_s()
            time.sleep(0.3)  # "training" step 1 with the weights of version 0
            busy[eta] = stream.busy_s() - b0
        finally:
            stream.close()
    assert busy[0] == 0.0  # eta 0: on-policy, nothing may be generated ahead of the trainer
    assert busy[1] > 0.1  # eta 1: the next step's groups are generated meanwhile


def test_a_group_with_an_aborted_sample_is_generated_again_first():
    server, drawn = Server(abort_first_try=frozenset({1})), []
    stream = make_stream(server, 1, drawn)
    stream.start()
    try:
        trained = train(stream, server, range(1, 4))
    finally:
        stream.close()
    groups = [g for gs in trained.values() for g in gs]
    again = [g for g in groups if g.prompt.index == 1]
    assert len(again) == 1 and again[0].attempt == 1  # trained once, from its second try
    assert all(r.finish_reason != "abort" for r in again[0].results)
    assert stream.counts.requeued_aborted == 1 and sum(stream.counts.requeued.values()) == 1
    assert stream.counts.requeued["new"] == 1  # never scored before: difficulty unknown


def test_a_restored_stream_trains_the_saved_groups_bit_for_bit():
    server, drawn = Server(), []
    stream = make_stream(server, 2, drawn)
    stream.start()
    try:
        train(stream, server, range(1, 3))
        time.sleep(0.2)  # groups complete in the buffer
        state = json.loads(json.dumps(stream.state(lambda: None)))  # as run_state.json holds it
    finally:
        stream.close()
    saved = state["rollout_stream"]
    assert saved["complete"], "nothing buffered: the test would show nothing"
    server2 = Server()
    server2.version = 2
    resumed = make_stream(server2, 2, drawn, start=2)
    resumed.restore(saved)
    resumed.start()
    try:
        got = resumed.take(3)
    finally:
        resumed.close()
    oldest = sorted(saved["complete"], key=lambda g: g["index"])[:P]
    assert [g.index for g in got[:len(oldest)]] == [g["index"] for g in oldest]
    for g, want in zip(got, oldest):
        assert [result_to_json(r) for r in g.results] == want["results"]
        assert g.rewards == want["rewards"]


class StoppableServer(Server):
    """A server whose requests an abort stops: each returns its output so far (SGLang's
    ``/abort_request``; a sample not started returns none), and that continues a sample from its
    output (``pipeline.generation.continuation.continue_samples``' request: prompt + output so far as the
    prompt). Output token t of sample s is ``100 * s + t`` with log-prob ``-t / 100``, so a
    joined sample shows whether its pieces are in place."""

    def __init__(self, token_s: float = 0.004):
        super().__init__(token_s=token_s)
        self.epoch = 0  # bumped by every abort
        self.continuations = 0

    async def abort(self) -> None:
        self.epoch += 1

    async def _sample(self, prompt_ids: list, rid: str, s: int, first: int, length: int):
        epoch, ids = self.epoch, []
        labels = []
        for t in range(first, length):
            if self.epoch != epoch:
                break
            await asyncio.sleep(self.token_s)
            ids.append(100 * s + t)
            labels.append(self.version)
        spans = spans_of(labels)
        done = first + len(ids) == length
        return RolloutResult(
            rid=rid, prompt_ids=list(prompt_ids), output_ids=ids,
            output_logprobs=[-(first + i) / 100 for i in range(len(ids))],
            finish_reason="stop" if done else "abort", matched_stop=None,
            prompt_tokens=len(prompt_ids), completion_tokens=len(ids),
            weight_version=labels[-1] if labels else self.version, server_url="sim",
            weight_versions=spans)

    async def generate(self, prompt, seed, rid):
        length = 60 if prompt.prompt_ids[0] % 2 == 0 else 6
        out = []
        for s in range(G):  # one after the other: a later sample is "queued" meanwhile
            out.append(await self._sample(prompt.prompt_ids, f"{rid}-{s}", s, 0, length))
        return out

    async def resume(self, prompt, seed, rid, partial):
        from pipeline.generation.continuation import join_continuation

        length = 60 if prompt.prompt_ids[0] % 2 == 0 else 6
        out = []
        for s, r in enumerate(partial):
            if r.finish_reason != "abort":
                out.append(r)
                continue
            self.continuations += 1
            cont = await self._sample(list(prompt.prompt_ids) + r.output_ids, f"{rid}-{s}", s,
                                      len(r.output_ids), length)
            out.append(join_continuation(r, cont))
        return out


def test_a_checkpoint_keeps_the_output_of_requests_in_flight_and_continues_it():
    server, drawn = StoppableServer(), []
    stream = make_stream(server, 1, drawn, abort=server.abort, resume=server.resume)
    stream.start()
    try:
        train(stream, server, range(1, 3))
        time.sleep(0.05)  # the long samples of the next groups are part-way
        state = json.loads(json.dumps(stream.state(lambda: None)))  # as run_state.json holds it
        saved = state["rollout_stream"]
        # this run goes on: the stopped samples are continued, not generated again
        trained = train(stream, server, range(3, 6))
    finally:
        stream.close()
    assert saved["partial"], "nothing was in flight: the test would show nothing"
    assert not saved["pending"]  # every group in flight came back with its output
    stopped = {(g["index"], s): r for g in saved["partial"] for s, r in enumerate(g["results"])
               if r["finish_reason"] == "abort"}
    assert any(0 < len(r["output_ids"]) < 60 for r in stopped.values())  # stopped part-way
    again = {(g.index, s): r for gs in trained.values() for g in gs
             for s, r in enumerate(g.results) if (g.index, s) in stopped}
    assert again and stream.counts.continued == len(again)  # counted when trained
    assert server.continuations >= len(again)

    # a run resumed from the checkpoint continues them too, under its own weights (version 7)
    server2 = StoppableServer()
    server2.version = 7
    resumed = make_stream(server2, 1, drawn, start=2, abort=server2.abort, resume=server2.resume)
    resumed.restore(saved)
    resumed.start()
    try:
        got = []
        for step in (3, 4, 5):  # the server's label stays 7: every continuation is labelled so
            got += resumed.take(step)
            resumed.set_version(step)
    finally:
        resumed.close()
    joined = {(g.index, s): r for g in got for s, r in enumerate(g.results)
              if (g.index, s) in stopped}
    assert set(joined) == set(stopped)  # every stopped sample was trained, none generated anew
    assert resumed.counts.continued == len(stopped) == server2.continuations
    for key, r in joined.items():
        before, s = stopped[key], key[1]
        n = len(before["output_ids"])
        assert r.finish_reason == "stop"
        assert r.output_ids == [100 * s + t for t in range(len(r.output_ids))]  # nothing lost
        assert r.output_ids[:n] == before["output_ids"]
        assert r.output_logprobs[:n] == before["output_logprobs"]  # the saved ones, bit for bit
        assert r.completion_tokens == len(r.output_ids) and r.prompt_ids == before["prompt_ids"]
        spans = [tuple(x) for x in before["weight_versions"]]
        assert r.weight_versions[:len(spans)] == spans  # the versions that generated them
        assert r.weight_versions[len(spans):] == [(7, n, len(r.output_ids))]


def test_a_stream_that_makes_no_progress_names_what_it_waited_for():
    class Stuck(Server):
        async def generate(self, prompt, seed, rid):
            await asyncio.sleep(60)

    stream = make_stream(Stuck(), 1, [], timeout_s=0.3)
    stream.start()
    try:
        with pytest.raises(TimeoutError, match=r"step 1 waited 0.3 s .*0/3 complete.*sim#0"):
            stream.take(1)
    finally:
        stream.close()


def test_a_rollout_error_reaches_the_trainer():
    class Broken(Server):
        async def generate(self, prompt, seed, rid):
            raise RuntimeError("server gone")

    stream = make_stream(Broken(), 1, [])
    stream.start()
    try:
        with pytest.raises(RuntimeError, match="server gone"):
            stream.take(1)
    finally:
        stream.close()


def test_admission_limit_and_difficulty_and_oldest_version():
    assert admission_limit(max_staleness=1, version=4, taken=4, prompts_per_step=8) == 16
    assert admission_limit(max_staleness=1, version=4, taken=5, prompts_per_step=8) == 8
    assert admission_limit(max_staleness=0, version=4, taken=5, prompts_per_step=8) == 0
    assert [difficulty(x) for x in (None, 0.0, 0.5, 1.0)] == ["new", "hard", "medium", "easy"]
    r = RolloutResult(rid="r", prompt_ids=[1], output_ids=[2, 3, 4], output_logprobs=[0.0] * 3,
                      finish_reason="stop", matched_stop=None, prompt_tokens=1,
                      completion_tokens=3, weight_version=5, server_url="u",
                      weight_versions=[Span(None, 0, 1), Span(4, 1, 2), Span(5, 2, 3)])
    assert oldest_version([r], default=9) == 4
    assert oldest_version([], default=9) == 9
    assert result_from_json(json.loads(json.dumps(result_to_json(r)))) == r
    before, after = StreamCounts(), StreamCounts()
    after.requeued["hard"] = 2
    after.requeued_stale = 2
    m = step_metrics(before, after)
    assert m["requeued"] == 2.0 and m["requeued_hard"] == 2.0 and m["dropped"] == 0.0


# ------------------------------------------------------------------ the loop in full mode
def _full_context(tmp_path, steps: int, save_interval: int = 0):
    from megatron_gspo.config import config_from_dict
    from tests.reliability.loop_fakes import loop_context

    ctx = loop_context(tmp_path, steps=steps, save_interval=save_interval)
    ctx.cfg = config_from_dict({
        "gspo": {"group_size": 4}, "rollout": {"async": "full", "max_staleness": 1},
        "run": {"num_steps": steps, "global_batch_size": 8, "micro_batch_size": 4,
                "seq_length": 16, "eval_interval": 0, "save_interval": save_interval}})
    return ctx


def test_the_loop_in_full_mode_trains_every_step_and_saves_the_stream(tmp_path):
    import torch.distributed as dist

    from pipeline.step import loop
    from pipeline.observe.metrics import read_metrics
    from tests.reliability.loop_fakes import FakePusher, FakeTrainer, init_world_of_one

    class Saving(FakeTrainer):
        def __init__(self):
            super().__init__()
            self.states = {}

        def save(self, run_dir, step, run_state):
            super().save(run_dir, step, run_state)
            self.states[step] = json.loads(json.dumps(run_state))  # as run_state.json holds it

    made = init_world_of_one()
    try:
        ctx = _full_context(tmp_path, steps=4, save_interval=2)
        ctx.weights = pusher = FakePusher()
        trainer = Saving()
        assert loop.run(ctx, trainer, start_step=0)["status"] == "finished"
        ctx.logger.close()
    finally:
        if made:
            dist.destroy_process_group()
    assert trainer.trained == [1, 2, 3, 4]
    assert pusher.pushes == ["0", "1", "2", "3", "4"]  # after every update, without waiting
    for step in (2, 4):
        state = trainer.states[step]
        assert set(state) == {"sampler", "rollout_stream"}
        stream = state["rollout_stream"]
        held = len(stream["complete"]) + len(stream["partial"]) + len(stream["pending"])
        # every prompt drawn is trained or held: 2 prompts per step
        assert state["sampler"]["index"] == 2 * step + held, state["sampler"]
    rows = [r for r in read_metrics(tmp_path) if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["train/dropped"] == 0.0 and r["train/requeued"] == 0.0
        assert 0.0 <= r["train/rollout_idle_frac"] <= 1.0


def test_a_full_mode_checkpoint_resumed_in_another_mode_is_refused():
    from megatron_gspo.config import ConfigError
    from pipeline.sources.base import check_resume

    saved = {"rollout_stream": {"complete": [{}] * 3, "pending": [{}]}}
    check_resume(saved, "full")  # consumed
    with pytest.raises(ConfigError, match=r"rollout\.async: one_step: the checkpoint was written "
                                          r"by a rollout\.async: full run and holds 3 complete "
                                          r"groups, 0 groups stopped in flight and 1 prompts "
                                          r"queued"):
        check_resume(saved, "one_step")
    check_resume({}, "off")  # a fresh start: nothing to refuse


def test_a_continuation_joins_only_its_own_partial_sample():
    from pipeline.generation.continuation import join_continuation

    def result(rid, prompt, out, spans, finish="abort"):
        return RolloutResult(rid=rid, prompt_ids=prompt, output_ids=out,
                             output_logprobs=[-0.1] * len(out), finish_reason=finish,
                             matched_stop=None, prompt_tokens=len(prompt),
                             completion_tokens=len(out), weight_version=spans[-1][0],
                             server_url="u", weight_versions=spans)

    partial = result("a", [1, 2], [3, 4, 5], [Span(1, 0, 2), Span(2, 2, 3)])
    cont = result("a-c", [1, 2, 3, 4, 5], [6, 7], [Span(2, 0, 1), Span(3, 1, 2)], finish="stop")
    joined = join_continuation(partial, cont)
    assert joined.output_ids == [3, 4, 5, 6, 7] and joined.finish_reason == "stop"
    assert joined.weight_versions == [(1, 0, 2), (2, 2, 4), (3, 4, 5)]  # 2 merged
    assert joined.rid == "a" and joined.prompt_ids == [1, 2] and joined.completion_tokens == 5
    # one turn over the whole output, all of it the model's: the reward scores all of it
    assert joined.output_mask == [1] * 5 and joined.final_turn_ids() == [3, 4, 5, 6, 7]
    assert joined.end_reason == "done" and joined.turns[0].finish_reason == "stop"
    with pytest.raises(ValueError, match=r"b: the continuation's prompt is not a's prompt"):
        join_continuation(partial, result("b", [1, 2, 3], [6], [Span(3, 0, 1)]))
    turns = result("t", [1], [2], [Span(1, 0, 1)])
    turns.turns.append(turns.turns[0])  # a trajectory of two model turns
    with pytest.raises(ValueError, match=r"t: a multi-turn trajectory is not continued"):
        join_continuation(turns, cont)
