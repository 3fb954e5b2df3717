"""Issue 11, item 12: ``reward.on_error: zero`` with every reward of a step failing is an error.

Counting failures as 0 is meant for a reward that fails now and then; when every sample fails
the "rewards" are all zeros, every advantage is 0 and the run learns nothing while reporting
success (it exited 0). ``compute_rewards`` stops with a ``RewardError`` naming the reward
function and one sample's error; a partial failure is still counted and reported.
"""

from __future__ import annotations

import pytest

from pipeline.scoring.data import Prompt
from pipeline.scoring.rewards import RewardError, RewardSample, compute_rewards


def always_fails(prompt, response_ids, response_text):
    raise ValueError("the reward service is down")


def fails_on_odd(prompt, response_ids, response_text):
    if len(response_ids) % 2:
        raise ValueError("odd")
    return 1.0


def samples(n: int) -> list[RewardSample]:
    prompt = Prompt(index=3, prompt_ids=[1, 2], label="x", text="1+1=", origin="t.jsonl:4")
    return [RewardSample(prompt=prompt, sample_index=i, response_ids=[7] * (i + 1),
                         response_text="y") for i in range(n)]


def test_every_reward_failing_stops_the_step_naming_the_reward_and_an_error():
    with pytest.raises(RewardError) as caught:
        compute_rewards(always_fails, samples(4), on_error="zero")
    message = str(caught.value)
    assert "every one of the 4 rewards failed" in message
    assert "always_fails" in message                           # which reward
    assert "ValueError: the reward service is down" in message  # a sample's error
    assert "prompt 3 (t.jsonl:4), sample 0" in message         # which sample
    assert "reward.on_error" in message


def test_some_failures_are_counted_as_zero_and_listed():
    result = compute_rewards(fails_on_odd, samples(4), on_error="zero")
    assert result.rewards == [0.0, 1.0, 0.0, 1.0]
    assert [f.sample_index for f in result.failures] == [0, 2]
