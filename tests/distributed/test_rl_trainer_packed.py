"""``RLTrainer.train_rollout`` with packed micro-batches and context parallelism equals the
single-process padded run: every reduced metric and every updated weight (1e-5 relative).

The rollout batch, variant and comparison are those of ``test_rl_trainer_layouts`` (token
fractions, sequence fractions, means, a std and extremes, k = 2 mini-batches, the forward-only
pass for log pi_old with the mismatch weight). Here the same trainer runs with
``run.max_tokens_per_micro_batch`` (packed sequences, token budget, DP balancing) and with
``parallel.context: 2`` (zigzag rows or zigzag-split packed sequences, the per-sequence CP
all-reduce, N over DP x CP, metrics of whole sequences on every CP rank).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from tests.distributed import rl_trainer_worker
from tests.distributed.layouts import assemble, max_rel_diff, tiny_config
from bench.spawn import run_on_ranks
from tests.distributed.test_rl_trainer_layouts import (GSPO, RUN, SCALE_FLOOR, STEP, TIMING,
                                                       TOLERANCE, rollout_batch)

# name -> (world, parallel section, run.max_tokens_per_micro_batch)
RUNS = {
    "packed": (1, {}, 40),
    "DP2packed": (2, {}, 48),
    "CP2rows": (2, {"context": 2}, None),
    "CP2packed": (2, {"context": 2}, 16),
    "CP2xTP2packed": (4, {"context": 2, "tensor": 2, "sequence_parallel": True}, 16),
}


def _run(world, section, budget, batch):
    cfg = tiny_config(section, gspo=GSPO, run={**RUN, "max_tokens_per_micro_batch": budget})
    results = run_on_ranks(world, rl_trainer_worker.run_train_rollout, (cfg, batch, STEP),
                           timeout_s=600)
    for r in results:  # every rank gets the same reduced metrics
        for key, value in r["metrics"].items():
            if key not in TIMING:
                assert value == results[0]["metrics"][key], key
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    metric_ranks = [r for r in results if r["is_metric_rank"]]
    return {"metrics": results[0]["metrics"], "weights": assemble(results, "weights", shapes),
            "updates": [m for r in metric_ranks for m in r["reduce_inputs"][1]]}


@pytest.fixture(scope="module")
def reference():
    batch = rollout_batch()
    return batch, _run(1, {}, None, batch)


@pytest.mark.parametrize("name", list(RUNS))
def test_train_rollout_packed_or_context_parallel_matches_padded(name, reference):
    batch, ref = reference
    world, section, budget = RUNS[name]
    run = _run(world, section, budget, batch)
    if budget is not None:  # fewer, fuller micro-batches than the 8 padded ones
        assert len(run["updates"]) < len(ref["updates"])
    assert run["metrics"].keys() == ref["metrics"].keys()
    bad = {k: (run["metrics"][k], v) for k, v in ref["metrics"].items() if k not in TIMING
           and abs(run["metrics"][k] - v) > TOLERANCE * max(abs(v), SCALE_FLOOR)}
    assert not bad, f"{name}: reduced metrics differ from the single-process padded run: {bad}"
    bad = {n: max_rel_diff(run["weights"][n], ref["weights"][n]) for n in ref["weights"]
           if max_rel_diff(run["weights"][n], ref["weights"][n]) > TOLERANCE}
    assert not bad, f"{name}: updated weights differ from the single-process padded run: {bad}"
    assert torch.isfinite(torch.tensor(list(run["metrics"].values()))).all()
