"""The parity watchdog's pure parts and its decision rule (``pipeline/weights/parity.py``,
``pipeline.step.phases.check_parity``), with a stand-in trainer and servers on a world of one.

The real servers' answers are tested in tests/rollout/test_parity_server.py, a real session with
a faithful and a perturbed server in tests/e2e/test_parity_watchdog.py.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.config import ConfigError, config_from_dict
from pipeline.step.phases import check_parity
from pipeline.engines.sglang import SGLangScorer
from pipeline.engines.vllm.client import VllmScorer
from pipeline.weights import parity
from pipeline.scoring.data import TaskPromptDataset
from pipeline.weights.parity import (ParityError, ParityResult, ParityWatchdog, Probe, gap_stats,
                             load_probes, probe_batch, response_values,
                             save_probes)
from pipeline.generation.client import RolloutError
from pipeline.scoring.tasks import AdditionTask
from tests.reliability.loop_fakes import init_world_of_one, loop_context

PROBES = [Probe([3, 4, 5], [6, 7]), Probe([8], [9, 10, 11])]


@pytest.fixture(scope="module", autouse=True)
def world():
    made = init_world_of_one()
    yield
    if made:
        dist.destroy_process_group()


def test_gap_stats_are_over_every_token():
    stats = gap_stats([[0.0, -1.0], [-2.0, -3.0, -4.0]], [[0.1, -1.0], [-2.0, -3.5, -4.0]])
    assert stats["num_tokens"] == 5
    assert stats["mean"] == pytest.approx((0.1 + 0.5) / 5)
    assert stats["max"] == pytest.approx(0.5)
    assert stats["signed_mean"] == pytest.approx((-0.1 + 0.5) / 5)
    with pytest.raises(ValueError, match="3 server values for 2"):
        gap_stats([[1.0, 2.0, 3.0]], [[1.0, 2.0]])


def test_probe_rows_and_their_response_positions():
    batch = probe_batch(PROBES, seq_length=8)
    assert batch["tokens"].shape == (2, 8)
    # the response tokens are the labels where the response mask is set (rl_batch's layout)
    for i, p in enumerate(PROBES):
        assert batch["labels"][i][batch["response_mask"][i]].tolist() == p.response_ids
    scored = torch.where(batch["response_mask"], batch["labels"].float(), 0.0)
    assert response_values(scored, PROBES) == [[6.0, 7.0], [9.0, 10.0, 11.0]]
    with pytest.raises(ValueError, match="parity probe sample 0.*run.seq_length"):
        probe_batch([Probe([1] * 6, [2] * 4)], seq_length=8)


def test_an_sglang_answer_is_read_and_checked():
    read = SGLangScorer().read_scores
    answer = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.5, 6, None],
                                                     [-0.25, 7, None]]}}
    assert read(answer, PROBES[0].prompt_ids, PROBES[0].response_ids, "http://s") == (
        [-0.5, -0.25], None)
    wrong = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-0.5, 6, None],
                                                    [-0.25, 8, None]]}}
    with pytest.raises(RolloutError, match="http://s.*not the response"):
        read(wrong, PROBES[0].prompt_ids, PROBES[0].response_ids, "http://s")
    with pytest.raises(RolloutError, match="1 input_token_logprobs for 2"):
        read({"meta_info": {"input_token_logprobs": [[None, 5, None]]}},
             PROBES[0].prompt_ids, PROBES[0].response_ids, "http://s")


def test_a_vllm_probe_request_and_answer():
    """vLLM 0.32's ``/inference/v1/generate`` with ``prompt_logprobs: 0``: one entry per input
    token (``None`` first), keyed by the token's id as a JSON string (the real server's answers:
    tests/engines/test_vllm_server.py)."""
    scorer, (prompt, response) = VllmScorer(), (PROBES[0].prompt_ids, PROBES[0].response_ids)
    path, body = scorer.score_call("parity-x-0", prompt, response)
    assert path == "/inference/v1/generate" and body["token_ids"] == [3, 4, 5, 6, 7]
    assert body["sampling_params"]["prompt_logprobs"] == 0
    assert body["sampling_params"]["max_tokens"] == 1 and body["stream"] is False
    entry = lambda t, v: {str(t): {"logprob": v, "rank": 1, "decoded_token": None}}  # noqa: E731
    answer = {"prompt_logprobs": [None, entry(4, -1.0), entry(5, -2.0), entry(6, -0.5),
                                  entry(7, -0.25)], "choices": [{"token_ids": [9]}]}
    assert scorer.read_scores(answer, prompt, response, "http://v") == ([-0.5, -0.25], None)
    other = {**answer, "prompt_logprobs": [*answer["prompt_logprobs"][:4], entry(8, -0.25)]}
    with pytest.raises(RolloutError, match=r"http://v.*prompt_logprobs\[4\] scores \['8'\], "
                                           "not the response token 7"):
        scorer.read_scores(other, prompt, response, "http://v")
    with pytest.raises(RolloutError, match="4 prompt_logprobs for 5 input tokens"):
        scorer.read_scores({"prompt_logprobs": answer["prompt_logprobs"][:4]}, prompt, response,
                           "http://v")
    with pytest.raises(RolloutError, match="malformed parity answer"):
        scorer.read_scores({"choices": []}, prompt, response, "http://v")
    with pytest.raises(ValueError, match="routed experts"):
        scorer.score_call("r", prompt, response, routed_experts=True)


def test_probe_file_round_trip_and_a_damaged_one(tmp_path):
    path = tmp_path / parity.PROBES_FILE
    save_probes(path, PROBES)
    assert load_probes(path) == PROBES
    path.write_text(json.dumps([{"prompt_ids": [1], "response_ids": []}]))
    with pytest.raises(ValueError, match="without prompt or response"):
        load_probes(path)


def test_probe_prompts_are_drawn_once_with_the_seed():
    task = AdditionTask(digits=2, seed=0)
    held_out = TaskPromptDataset(task, split="eval", size=20)
    a = parity.draw_probe_prompts(held_out, None, 5, seed=3)
    assert [p.index for p in a] == [p.index for p in parity.draw_probe_prompts(held_out, None, 5,
                                                                               seed=3)]
    assert [p.index for p in a] != [p.index for p in parity.draw_probe_prompts(held_out, None, 5,
                                                                               seed=4)]
    assert len({p.index for p in a}) == 5 and all("eval" in p.origin for p in a)
    train = TaskPromptDataset(task, split="train")
    assert all("train" in p.origin for p in parity.draw_probe_prompts(None, train, 3, seed=3))


def test_result_metrics_name_the_worst_server():
    result = ParityResult(["http://a", "http://b"],
                          [gap_stats([[0.0]], [[0.01]]), gap_stats([[0.0, 0.0]], [[0.3, 0.1]])],
                          threshold=0.1)
    assert result.failed and result.worst()[0] == "http://b"
    m = result.metrics()
    assert m["parity/logprob_gap_mean"] == pytest.approx(0.2)
    assert m["parity/logprob_gap_max"] == pytest.approx(0.3)
    assert m["parity/server0_logprob_gap_mean"] == pytest.approx(0.01)
    assert m["parity/server1_logprob_gap_max"] == pytest.approx(0.3)
    assert "http://b" in result.describe() and "parity.max_gap_mean 0.1" in result.describe()


def test_parity_config_is_validated():
    with pytest.raises(ConfigError, match="parity.num_probes"):
        config_from_dict({"parity": {"num_probes": 0}})
    with pytest.raises(ConfigError, match="parity.max_gap_mean"):
        config_from_dict({"parity": {"max_gap_mean": 0.0}})


class StandInServers(ParityWatchdog):
    """Answers with the trainer's values plus ``offsets[k]`` at the k-th check (per server)."""

    def __init__(self, cfg, run_dir, offsets):
        super().__init__(cfg, run_dir, SGLangScorer())
        self.offsets, self.calls = list(offsets), 0

    def server_scores(self, urls, client, stop_token_ids):
        offset = self.offsets[min(self.calls, len(self.offsets) - 1)]
        self.calls += 1
        truth = Trainer.values()
        return {"probes": PROBES, "urls": list(urls), "routed": None, "unreachable": [],
                "scores": {u: [[v + offset for v in row] for row in truth] for u in urls}}


class Trainer:
    @staticmethod
    def values():
        return [[-1.0, -2.0], [-0.5, -0.25, -3.0]]

    def score_log_probs(self, batch, *, temperature):
        assert temperature == 1.0
        out = torch.zeros(batch["tokens"].shape)
        for i, (p, row) in enumerate(zip(PROBES, self.values())):
            start = len(p.prompt_ids) - 1
            out[i, start:start + len(row)] = torch.tensor(row)
        return out

    def hf_buckets(self):
        return []


def _ctx(tmp_path, offsets):
    ctx = loop_context(tmp_path, steps=1)
    cfg = config_from_dict({"parity": {"enabled": True, "max_gap_mean": 0.01},
                            "run": {"seq_length": 16}})
    ctx.server_urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    ctx.parity = StandInServers(cfg, tmp_path, offsets)
    return ctx


def test_a_gap_is_logged_and_nothing_is_resynced_below_the_threshold(tmp_path):
    ctx = _ctx(tmp_path, [1e-3])
    metrics = check_parity(ctx, Trainer(), 3)
    assert metrics["parity/logprob_gap_mean"] == pytest.approx(1e-3)
    assert metrics["parity/servers"] == 2 and "parity/resyncs" not in metrics
    assert ctx.weights.pushes == []


def test_one_resync_that_cures_the_gap(tmp_path):
    ctx = _ctx(tmp_path, [0.5, 1e-4])
    metrics = check_parity(ctx, Trainer(), 3)
    assert ctx.weights.pushes == ["3"] and metrics["parity/resyncs"] == 1
    assert metrics["parity/logprob_gap_mean"] == pytest.approx(1e-4)


def test_a_gap_that_persists_stops_the_run_naming_gap_server_and_threshold(tmp_path):
    ctx = _ctx(tmp_path, [0.5, 0.25])
    with pytest.raises(ParityError) as err:
        check_parity(ctx, Trainer(), 3)
    assert ctx.weights.pushes == ["3"]  # synced once more, then stopped
    message = str(err.value)
    assert message.startswith("rollout server http://127.0.0.1:1: mean per-token log-prob gap 0.25")
    assert "exceeds parity.max_gap_mean 0.01" in message and "before: 0.5" in message


def test_without_a_watchdog_nothing_is_checked(tmp_path):
    ctx = loop_context(tmp_path, steps=1)
    assert check_parity(ctx, Trainer(), 1) == {}


def test_a_server_that_died_after_the_sync_is_counted_not_checked(tmp_path, capsys):
    from pipeline.servers.cluster import free_port

    cfg = config_from_dict({"parity": {"enabled": True}, "rollout": {"request_timeout_s": 5.0}})
    watchdog = ParityWatchdog(cfg, tmp_path, SGLangScorer())
    watchdog.probes = PROBES
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RolloutError, match="no rollout server answered"):
        watchdog.server_scores([dead], None, [])
    assert "did not answer" in capsys.readouterr().out
    served = {"probes": PROBES, "urls": [], "scores": {}, "routed": None, "unreachable": [dead]}
    served["urls"], served["scores"] = ["http://a"], {"http://a": Trainer.values()}
    result = watchdog.compare(served, Trainer())
    assert result.metrics()["parity/servers_unreachable"] == 1 and not result.failed
