"""The sample type (``pipeline.generation.trajectory``), the weight version
(``pipeline.generation.version``) and the generators (``pipeline.generation.generator``,
``pipeline.generation.multiturn.ToolGenerator``), without a server.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_trajectory.py``
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from megatron_gspo.train.checkpoint.run_state import join_tensors, split_tensors
from pipeline.generation.client import SamplingParams
from pipeline.generation.generator import SingleTurnGenerator
from pipeline.generation.multiturn import ToolGenerator
from pipeline.generation.trajectory import (EndReason, RolloutResult, Span, Turn,
                                            result_from_json, result_to_json)
from pipeline.generation.version import from_wire, to_wire
from pipeline.scoring.data import Prompt

# What ``result_to_json`` wrote before samples were typed (commit 9519c99), in a ``full`` run's
# checkpoint: a one-turn sample (no mask, turns or end reason) and a tool-using trajectory (turns
# as dicts, the environment's reward a "reward" key of the last one, the servers' labels).
OLD_ONE_TURN = (
    '{"rid": "s0a0-p0-s1", "prompt_ids": [5, 6], "output_ids": [7, 8, 9], "output_logprobs": '
    '[-0.25, -1.5, -0.125], "finish_reason": "stop", "matched_stop": 9, "prompt_tokens": 2, '
    '"completion_tokens": 3, "weight_version": "3", "server_url": "http://s0", '
    '"weight_versions": [["2", 0, 1], ["3", 1, 3]], "routed_experts": [[[1]], [[2]], [[3]], '
    '[[0]]], "cached_tokens": 1, "output_mask": null, "turns": null, "end_reason": null}')
OLD_TRAJECTORY = (
    '{"rid": "mt-p0-s0", "prompt_ids": [5], "output_ids": [7, 8, 1, 2, 9], "output_logprobs": '
    '[-0.5, -0.75, 0.0, 0.0, -0.25], "finish_reason": "stop", "matched_stop": 9, '
    '"prompt_tokens": 1, "completion_tokens": 3, "weight_version": "default", "server_url": '
    '"http://s1", "weight_versions": [["default", 0, 2], ["1", 4, 5]], "routed_experts": null, '
    '"cached_tokens": 3, "output_mask": [1, 1, 0, 0, 1], "turns": [{"start": 0, "length": 2, '
    '"observation_length": 2, "finish_reason": "stop", "cached_tokens": 0, "prompt_tokens": 1, '
    '"server_url": "http://s1", "tool_calls": 1, "tool_errors": 1, "tool_seconds": 0.5, '
    '"errors": ["timeout"]}, {"start": 4, "length": 1, "observation_length": 0, '
    '"finish_reason": "stop", "cached_tokens": 3, "prompt_tokens": 5, "server_url": '
    '"http://s1", "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0, "errors": [], '
    '"reward": 1.0}], "end_reason": "done"}')


def one_turn(**kw) -> RolloutResult:
    fields = dict(rid="r", prompt_ids=[1, 2], output_ids=[3, 4, 5], output_logprobs=[-0.5] * 3,
                  finish_reason="length", matched_stop=None, prompt_tokens=2,
                  completion_tokens=3, weight_version=4, server_url="http://s0",
                  weight_versions=[Span(4, 0, 3)], cached_tokens=1)
    return RolloutResult(**{**fields, **kw})


def test_the_weight_version_is_an_int_and_a_string_on_the_wire_only():
    assert to_wire(7) == "7" and to_wire(0) == "0" and to_wire(-1) == "-1"
    assert from_wire("7") == 7 and from_wire("-1") == -1 and from_wire(to_wire(12)) == 12
    for label in ("default", "", None, "v1", "1.5", "--3", " 3"):  # a server's own labels
        assert from_wire(label) is None, label


def test_a_one_turn_sample_is_a_trajectory_with_one_turn_and_an_all_ones_mask():
    r = one_turn()
    assert r.output_mask == [1, 1, 1] and r.end_reason is EndReason.MAX_TOKENS
    assert r.turns == [Turn(start=0, length=3, observation_length=0, finish_reason="length",
                            cached_tokens=1, prompt_tokens=2, server_url="http://s0")]
    assert r.final_turn_ids() == [3, 4, 5] and r.env_reward is None
    assert [one_turn(finish_reason=f).end_reason for f in ("stop", "length", "abort")] == [
        "done", "max_tokens", "abort"]
    with pytest.raises(ValueError, match=r"sample r: output_mask has 2 values for 3 output ids"):
        one_turn(output_mask=[1, 0])


def test_json_round_trips_bit_exact():
    r = one_turn(weight_versions=[Span(None, 0, 1), Span(4, 1, 3)], weight_version=None,
                 routed_experts=torch.arange(16, dtype=torch.int32).view(4, 2, 2))
    t = one_turn(output_ids=[3, 9, 5], output_mask=[1, 0, 1], env_reward=0.75,
                 end_reason=EndReason.TOOL_ERROR,
                 turns=[Turn(start=0, length=1, observation_length=1, finish_reason="stop",
                             cached_tokens=0, prompt_tokens=2, server_url="u", tool_calls=2,
                             tool_errors=1, tool_seconds=0.1 + 0.2, errors=("malformed",)),
                        Turn(start=2, length=1, observation_length=0, finish_reason="length",
                             cached_tokens=3, prompt_tokens=4, server_url="u")])
    for sample in (r, t):
        back = result_from_json(through_run_state(result_to_json(sample)))
        assert back.routed_experts is None or torch.equal(back.routed_experts,
                                                          sample.routed_experts)
        (got, got_tensors), (want, want_tensors) = (split_tensors(result_to_json(x))
                                                    for x in (back, sample))
        assert got == want and got_tensors.keys() == want_tensors.keys()
        assert all(torch.equal(got_tensors[k], want_tensors[k]) for k in want_tensors)
    assert result_from_json(through_run_state(result_to_json(t))) == t


def through_run_state(state: dict) -> dict:
    # as a checkpoint keeps it: the tensors apart (run_state.safetensors), the rest as JSON text
    placeholders, tensors = split_tensors(state)
    return join_tensors(json.loads(json.dumps(placeholders)), tensors, source="run_state.safetensors")


def test_a_checkpoint_written_before_samples_were_typed_is_read():
    r = result_from_json(json.loads(OLD_ONE_TURN))
    assert r.weight_version == 3 and r.weight_versions == [Span(2, 0, 1), Span(3, 1, 3)]
    assert r.output_mask == [1, 1, 1] and r.end_reason is EndReason.DONE and r.env_reward is None
    assert r.turns == [Turn(start=0, length=3, observation_length=0, finish_reason="stop",
                            cached_tokens=1, prompt_tokens=2, server_url="http://s0")]
    assert r.output_logprobs == [-0.25, -1.5, -0.125] and r.routed_experts.dtype == torch.int32
    assert r.routed_experts[:, 0, 0].tolist() == [1, 2, 3, 0]

    t = result_from_json(json.loads(OLD_TRAJECTORY))
    assert t.weight_version is None and t.weight_versions == [Span(None, 0, 2), Span(1, 4, 5)]
    assert t.output_mask == [1, 1, 0, 0, 1] and t.end_reason is EndReason.DONE
    assert t.env_reward == 1.0 and len(t.turns) == 2 and t.final_turn_ids() == [9]
    assert t.turns[0].errors == ("timeout",) and t.turns[0].tool_seconds == 0.5
    assert t.turns[1] == Turn(start=4, length=1, observation_length=0, finish_reason="stop",
                              cached_tokens=3, prompt_tokens=5, server_url="http://s1")
    # and written again in today's form, it reads back the same
    assert result_from_json(through_run_state(result_to_json(t))) == t


def through_run_state(state: dict) -> dict:
    # as a checkpoint keeps it: the tensors apart (run_state.safetensors), the rest as JSON text
    placeholders, tensors = split_tensors(state)
    return join_tensors(json.loads(json.dumps(placeholders)), tensors, source="run_state.safetensors")


class FakeClient:
    def __init__(self):
        self.calls, self.aborts = [], 0

    def generate_groups(self, prompts, group_size, sampling, **kw):
        self.calls.append(("sync", prompts, group_size, kw))
        return [[one_turn(prompt_ids=list(p)) for _ in range(group_size)] for p in prompts]

    async def generate_groups_async(self, prompts, group_size, sampling, **kw):
        self.calls.append(("async", prompts, group_size, kw))
        return [[one_turn(prompt_ids=list(p)) for _ in range(group_size)] for p in prompts]

    async def abort_all(self):
        self.aborts += 1


def prompt(i: int) -> Prompt:
    return Prompt(index=i, prompt_ids=[i, i + 1], label=None, text="", origin="t")


def test_the_single_turn_generator_sends_the_prompts_ids_and_can_continue():
    client = FakeClient()
    gen = SingleTurnGenerator(client)
    groups = gen.generate([prompt(1), prompt(5)], 2, SamplingParams(), seed=3, rid_prefix="s1r0",
                          routed_experts=(2, 1))
    assert [len(g) for g in groups] == [2, 2] and groups[1][0].prompt_ids == [5, 6]
    assert client.calls == [("sync", [[1, 2], [5, 6]], 2,
                              {"seed": 3, "rid_prefix": "s1r0", "routed_experts": (2, 1)})]
    asyncio.run(gen.generate_async([prompt(2)], 3, SamplingParams(), seed=4, rid_prefix="x"))
    assert client.calls[-1] == ("async", [[2, 3]], 3,
                                {"seed": 4, "rid_prefix": "x", "routed_experts": None})
    asyncio.run(gen.abort_all())
    assert gen.can_continue() and client.aborts == 1 and gen.metrics(groups[0]) == {}
    # a group with no aborted sample comes back as it is, without a request
    done = [one_turn(finish_reason="stop")]
    assert asyncio.run(gen.continue_group(prompt(1), done, SamplingParams(), seed=1,
                                          rid_prefix="c")) == done


def test_the_tool_generator_cannot_continue_and_reports_trajectory_metrics():
    from megatron_gspo.config import config_from_dict

    cfg = config_from_dict({"tools": {"functions": ["pipeline.scoring.tasks:add"]}})
    gen = ToolGenerator(cfg, FakeClient(), encode_text=lambda s: [1], decode=lambda ids: "")
    try:
        assert not gen.can_continue()
        with pytest.raises(NotImplementedError, match="generated again"):
            asyncio.run(gen.continue_group(prompt(1), [one_turn()], SamplingParams(), seed=1,
                                           rid_prefix="c"))
        m = gen.metrics([one_turn(), one_turn(finish_reason="stop")])
        assert m["num_turns/mean"] == 1.0 and m["end_reason/max_tokens"] == 0.5
        assert m["end_reason/done"] == 0.5 and m["trained_tokens"] == 6.0
    finally:
        gen.close()
