"""``rollout.async``: the config switch, the rollout producer's schedule and checkpoint state, and
the per-token staleness metrics (the end-to-end runs: tests/e2e/test_async_one_step.py).

Run: ``.venv/bin/python -m pytest -q tests/unit/test_async_one_step.py``
"""

from __future__ import annotations

import threading

import pytest
import torch

from megatron_gspo.config import ConfigError, config_from_dict, dump_config, load_config
from pipeline.sources.base import BUFFER_KEY
from pipeline.sources.batch import staleness_metrics
from pipeline.sources.one_step import RolloutProducer
from pipeline.generation.client import RolloutResult
from pipeline.generation.trajectory import Span
from pipeline.generation.version import from_wire


# ------------------------------------------------------------------ the switch
@pytest.mark.parametrize("value, expected", [("one_step", "one_step"), ("off", "off"),
                                             (False, "off")])  # YAML 1.1: a bare off is false
def test_the_switch_reads_its_yaml_key(value, expected):
    assert config_from_dict({"rollout": {"async": value}}).rollout.async_ == expected


def test_the_switch_from_the_command_line_and_in_the_dump(tmp_path):
    cfg = load_config(None, overrides=["rollout.async=off"])  # YAML parses this off as false
    assert cfg.rollout.async_ == "off"
    cfg = load_config(None, overrides=["rollout.async=one_step"])
    dumped = dump_config(cfg)
    assert "  async: one_step\n" in dumped and "async_" not in dumped
    path = tmp_path / "c.yaml"
    path.write_text(dumped)
    assert load_config(path).rollout.async_ == "one_step"  # the dump loads back


@pytest.mark.parametrize("rollout, message", [
    ({"async": "fully"}, r"rollout\.async: 'fully' is not one of \['off', 'one_step', 'full'\]"),
    ({"async": "full", "colocated": True}, r"rollout\.async: full needs the rollout servers"),
    ({"async": "one_step", "max_staleness": 0}, r"rollout\.max_staleness: 0 is below "
                                                r"rollout\.async one_step's staleness"),
    ({"async": "full", "max_staleness": -1}, r"rollout\.max_staleness: must be >= 0, got -1"),
    ({"async": True}, r"rollout\.async: True is not one of"),
    ({"async_": "off"}, r"rollout\.async_: unknown key"),
    ({"async": "one_step", "colocated": True}, r"rollout\.async: one_step needs the rollout "
                                               r"servers on their own devices"),
])
def test_bad_switch_values_name_the_field(rollout, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"rollout": rollout})


# ------------------------------------------------------------------ the producer
class _Sampler:
    def __init__(self):
        self.position = 0

    def state_dict(self):
        return {"position": self.position}


def _batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"tokens": torch.randint(0, 50, (4, 9), generator=g),
            "rollout_log_probs": -torch.rand(4, 8, generator=g, dtype=torch.float32),
            "advantages": torch.randn(4, generator=g, dtype=torch.float64),
            "response_mask": torch.rand(4, 8, generator=g) > 0.5}


def test_the_producer_runs_the_next_rollout_on_a_thread_and_hands_it_over():
    sampler, release = _Sampler(), threading.Event()
    threads = []

    def make(step):
        threads.append(threading.current_thread().name)
        release.wait(10)
        sampler.position += 1  # its prompts are drawn
        return _batch(step), {"reward_mean": float(step)}

    producer = RolloutProducer(make, sampler.state_dict)
    producer.start(3)
    assert producer.pending_step == 3
    # running: a checkpoint now holds the position from before its prompts, and no batch
    assert producer.state({"position": 99}) == {"sampler": {"position": 0}}
    release.set()
    producer.wait()
    state = producer.state(sampler.state_dict())
    assert state["sampler"] == {"position": 1} and state[BUFFER_KEY]["step"] == 3
    batch, metrics = producer.take(3)
    assert threads == ["rollout step 3"] and metrics == {"reward_mean": 3.0}
    assert all(torch.equal(batch[k], _batch(3)[k]) for k in batch)
    assert producer.pending_step is None
    with pytest.raises(RuntimeError, match="no rollout of step 4"):
        producer.take(4)


def test_a_failed_rollout_is_raised_and_not_saved():
    sampler = _Sampler()

    def make(step):
        sampler.position += 1
        raise ValueError("server gone")

    producer = RolloutProducer(make, sampler.state_dict)
    producer.start(5)
    with pytest.raises(ValueError, match="server gone"):
        producer.wait()
    # the prompts it drew are drawn again by the resumed run
    assert producer.state(sampler.state_dict()) == {"sampler": {"position": 0}}


def test_the_saved_buffer_is_bit_exact_and_restores(tmp_path):
    """The producer's buffer through a checkpoint's run state (its tensors in
    run_state.safetensors) back into a producer: bit for bit."""
    from megatron_gspo.train.checkpoint.run_state import read_run_state, write_run_state

    batch = _batch(7)
    write_run_state(tmp_path, 7, {BUFFER_KEY: {"step": 8, "batch": batch,
                                               "metrics": {"reward_mean": 0.5}}})
    saved = read_run_state(tmp_path, {"files": {p.name: {} for p in tmp_path.iterdir()}},
                           tensors=True)[BUFFER_KEY]
    producer = RolloutProducer(lambda s: (_ for _ in ()).throw(AssertionError("not made")),
                               _Sampler().state_dict)
    producer.restore(saved)
    assert producer.pending_step == 8
    got, metrics = producer.take(8)
    assert got.keys() == batch.keys()
    for k in batch:
        assert got[k].dtype == batch[k].dtype and torch.equal(got[k], batch[k])
    assert metrics == {"reward_mean": 0.5}


# ------------------------------------------------------------------ staleness
def _result(spans, n):
    return RolloutResult(rid="r", prompt_ids=[1], output_ids=[2] * n, output_logprobs=[0.0] * n,
                         finish_reason="length", matched_stop=None, prompt_tokens=1,
                         completion_tokens=n, weight_version=from_wire(spans[-1][0]),
                         server_url="u",
                         weight_versions=[Span(from_wire(v), a, b) for v, a, b in spans])


def test_staleness_is_counted_per_token():
    # trained policy: the weights after step 4; one sample from 4 (fresh), one 3 tokens from 2
    # and 1 from 3 (a sample that lived across a push), one from the server's initial label
    results = [_result([("4", 0, 2)], 2), _result([("2", 0, 3), ("3", 3, 4)], 4),
               _result([("default", 0, 5)], 5)]
    m = staleness_metrics(results, trained=4)
    ages = [0, 0, 2, 2, 2, 1]  # reference, written out
    assert m["staleness_mean"] == pytest.approx(sum(ages) / len(ages))
    assert m["staleness_max"] == 2.0
    assert m["staleness_frac_0"] == pytest.approx(2 / 6)
    assert m["staleness_frac_1"] == pytest.approx(1 / 6)
    assert m["staleness_frac_2"] == pytest.approx(3 / 6)
    assert m["staleness_frac_3plus"] == 0.0
    assert staleness_metrics([_result([("default", 0, 3)], 3)], trained=0) == {}


def test_a_rollout_that_does_not_end_is_a_timeout_naming_the_step():
    release = threading.Event()
    producer = RolloutProducer(lambda s: (release.wait(30), ({}, {}))[1], _Sampler().state_dict,
                               timeout_s=0.2)
    producer.start(4)
    with pytest.raises(TimeoutError, match=r"the rollout of step 4 did not finish within 0.2 s"):
        producer.wait()
    assert producer.state({"position": 7}) == {"sampler": {"position": 0}}  # not saved as done
    release.set()
