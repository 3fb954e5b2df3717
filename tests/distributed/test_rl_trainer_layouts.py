"""``RLTrainer.train_rollout`` itself gives the same metrics and weights under every layout.

One rollout batch of 16 sequences (response lengths 0..12 tokens, so the micro-batches hold very
different token counts), k = 2 mini-batches, micro-batch size 2: 4 micro-batches per mini-batch in
one process, 2 per rank under DP2, 4 on each rank under TP2 (whose ranks hold copies of the same
metrics) and under PP2 (where only the last stage has metrics). The trainer runs exactly as in a
training run: its layout-independent initialisation, the forward-only pass for log pi_old, two
optimizer steps, the reduction of its metrics over micro-batches, mini-batches and ranks. Every
reduced metric must equal the single-process value (1e-5 relative, SCALE_FLOOR below) and so must
every updated weight. The token-clip variant with the mismatch weight
and an entropy bonus makes the batch report token fractions, sequence fractions, means, a std and
extremes; the test also checks that weighting the token fractions by sequences instead of tokens
would give visibly different numbers on this batch, so a mis-weighted reduction cannot pass.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from tests.distributed import rl_trainer_worker
from tests.distributed.layouts import LAYOUTS, assemble, max_rel_diff, tiny_config
from bench.spawn import run_on_ranks

TOLERANCE = 1e-5
# Metrics below 0.1 in size are compared to 1e-5 * 0.1 absolute: log-ratios are differences of two
# fp32 log-probs of size log(V) = 5.5, whose rounding (vocab-parallel under TP) is a few 1e-7
# absolute; a clip fraction mis-counted by one token moves by more than 1e-3.
SCALE_FLOOR = 0.1
STEP = 3  # the mini-batch permutation is seeded by (run.seed, step)
RESPONSE_LENGTHS = [1, 11, 5, 0, 8, 3, 12, 2, 7, 9, 4, 10, 6, 1, 12, 3]  # row 3: padding
GSPO = {"variant": "grpo", "token_eps_low": 2e-3, "token_eps_high": 2e-3,
        "updates_per_rollout": 2, "old_logprobs": "recompute", "mismatch_correction": True,
        "mismatch_cap": 1.1, "entropy_coef": 0.01}
RUN = {"seed": 7, "micro_batch_size": 2, "global_batch_size": 16, "seq_length": 16}
TIMING = ("train_s", "train_tokens_per_s")


def rollout_batch(seed: int = 11, seq: int = 16, vocab: int = 250) -> dict:
    """What ``megatron_gspo.train.batching.rl_batch`` makes of 16 sampled responses."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(RESPONSE_LENGTHS)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    prompt_len = torch.randint(2, 6, (rows,), generator=gen)
    response_len = torch.tensor(RESPONSE_LENGTHS)
    positions = torch.arange(seq).expand(rows, seq)
    response_mask = (positions >= prompt_len[:, None] - 1) & (
        positions < (prompt_len + response_len)[:, None] - 1)
    # the rollout engine's log-probs: near the untrained policy's -log(V), not equal to them
    rollout = -math.log(vocab) + 0.3 * torch.randn(rows, seq, generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": positions.contiguous(),
        "response_mask": response_mask,
        "rollout_log_probs": torch.where(response_mask, rollout, 0.0),
        "advantages": torch.randn(rows, generator=gen),
    }


def _run(layout: str, batch: dict, gspo: dict = GSPO) -> dict:
    world, parallel = LAYOUTS[layout]
    cfg = tiny_config(parallel, gspo=gspo, run=RUN)
    results = run_on_ranks(world, rl_trainer_worker.run_train_rollout, (cfg, batch, STEP),
                           timeout_s=300)
    for rank, r in enumerate(results):  # the reduction is collective: every rank has the result
        assert r["metrics"].keys() == results[0]["metrics"].keys()
        for key, value in r["metrics"].items():
            if key not in TIMING:
                assert value == results[0]["metrics"][key], (layout, rank, key)
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    metric_ranks = [r for r in results if r["is_metric_rank"]]
    return {"metrics": results[0]["metrics"],
            "before": assemble(results, "before", shapes),
            "weights": assemble(results, "weights", shapes),
            # the micro-batch metrics the metric ranks reduced: [forward-only pass, updates]
            "forward_only": [m for r in metric_ranks for m in r["reduce_inputs"][0]],
            "units": results[0]["units"],
            "updates": [m for r in metric_ranks for m in r["reduce_inputs"][1]]}


def _by_sequences(microbatches: list[dict], key: str) -> float:
    """The reduction this test must rule out: every mean weighted by sequences."""
    total = sum(m["num_sequences"] for m in microbatches)
    return sum(m[key] * m["num_sequences"] for m in microbatches) / total


@pytest.fixture(scope="module")
def reference():
    batch = rollout_batch()
    return batch, _run("1", batch)


def test_reference_batch_exercises_the_weighting(reference):
    batch, ref = reference
    metrics = ref["metrics"]
    tokens = int(batch["response_mask"].sum())
    assert metrics["num_sequences"] == 15 and metrics["num_tokens"] == tokens
    assert len(ref["updates"]) == 8 and len(ref["forward_only"]) == 8  # 2 mini-batches x 4
    token_counts = [m["num_tokens"] for m in ref["updates"]]
    assert max(token_counts) >= 2 * min(token_counts), token_counts
    assert 0 < metrics["token_clip_frac"] < 0.5 and 0 < metrics["mismatch_capped_frac"] < 1
    for key, microbatches in (("token_clip_frac", ref["updates"]),
                              ("mismatch_log_prob_abs_diff_mean", ref["updates"]),
                              ("rollout_trainer_logprob_abs_diff", ref["forward_only"])):
        wrong = _by_sequences(microbatches, key)
        assert abs(wrong - metrics[key]) > 100 * TOLERANCE * abs(metrics[key]), key
    # the forward-only pass saw the same rows as the updates
    assert sum(m["num_tokens"] for m in ref["forward_only"]) == tokens
    moved = max(max_rel_diff(ref["weights"][n], ref["before"][n]) for n in ref["weights"])
    assert moved > 1e-3


@pytest.mark.parametrize("layout", ["DP2", "TP2", "PP2"])
def test_train_rollout_matches_single_process(layout, reference):
    batch, ref = reference
    run = _run(layout, batch)
    for name in ref["before"]:  # the same starting point, whatever the layout
        assert torch.equal(run["before"][name], ref["before"][name]), name
    assert run["metrics"].keys() == ref["metrics"].keys()
    bad = {k: (run["metrics"][k], v) for k, v in ref["metrics"].items() if k not in TIMING
           and abs(run["metrics"][k] - v) > TOLERANCE * max(abs(v), SCALE_FLOOR)}
    assert not bad, f"{layout}: reduced metrics differ from the single-process run: {bad}"
    bad = {n: max_rel_diff(run["weights"][n], ref["weights"][n]) for n in ref["weights"]
           if max_rel_diff(run["weights"][n], ref["weights"][n]) > TOLERANCE}
    assert not bad, f"{layout}: updated weights differ from the single-process run: {bad}"


@pytest.mark.parametrize("variant", ["cispo", "sapo", "luspo", "gmpo"])
def test_later_objectives_train_under_data_parallelism_as_in_one_process(variant):
    # the four objectives the field ships (issue 26) through the trainer: DP2 equals one process,
    # and the loss units are what each objective normalises by: response tokens for cispo and
    # luspo (a mean over tokens), sequences for sapo and gmpo
    batch = rollout_batch()
    gspo = {**GSPO, "variant": variant}
    ref, run = _run("1", batch, gspo), _run("DP2", batch, gspo)
    tokens, sequences = int(batch["response_mask"].sum()), 15
    assert sum(ref["units"]) == (tokens if variant in ("cispo", "luspo") else sequences)
    assert run["units"] == ref["units"] and len(ref["units"]) == 2
    bad = {k: (run["metrics"][k], v) for k, v in ref["metrics"].items() if k not in TIMING
           and abs(run["metrics"][k] - v) > TOLERANCE * max(abs(v), SCALE_FLOOR)}
    assert not bad, f"{variant} DP2: reduced metrics differ from the single-process run: {bad}"
    moved = max(max_rel_diff(ref["weights"][n], ref["before"][n]) for n in ref["weights"])
    assert moved > 1e-3, f"{variant}: the update did not move the weights"
    bad = {n: max_rel_diff(run["weights"][n], ref["weights"][n]) for n in ref["weights"]
           if max_rel_diff(run["weights"][n], ref["weights"][n]) > TOLERANCE}
    assert not bad, f"{variant} DP2: updated weights differ from the single-process run: {bad}"
