"""``RLTrainer.score_log_probs`` (the parity watchdog's and calibrate-eps's trainer side) gives
the single-process tensor on every rank of every layout.

Five rows (not a multiple of DP x micro-batch size 2: the padding rows must be dropped), response
lengths 1..9, scored under CP2xDP2 (rows split over two data-parallel ranks, each row's zigzag
halves on two context-parallel ranks, reassembled by position) and PP2xTP2 (values only on the
last stage, TP peers holding copies, sequence parallelism): every rank must return the
single-process values (1e-5 absolute: fp32 log-probs of size log V, vocab-parallel under
TP), zeros off the response mask, negative and finite on it.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.train.batching import rl_batch
from tests.distributed import scoring_worker
from tests.distributed.layouts import tiny_config
from bench.spawn import run_on_ranks

LAYOUTS = {"1": (1, {}), "CP2xDP2": (4, {"context": 2}),
           "PP2xTP2": (4, {"tensor": 2, "sequence_parallel": True, "pipeline": 2})}
RUN = {"seed": 5, "micro_batch_size": 2, "global_batch_size": 8, "seq_length": 16}
GSPO = {"group_size": 2}


def probe_rows() -> dict:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (3, 5, 2, 6, 4)]
    responses = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in (1, 9, 4, 7, 2)]
    return rl_batch(prompts, responses, [[0.0] * len(r) for r in responses], torch.zeros(5),
                    16, 0)


@pytest.fixture(scope="module")
def single():
    batch = probe_rows()
    world, parallel = LAYOUTS["1"]
    return batch, run_on_ranks(world, scoring_worker.run_score,
                               (tiny_config(parallel, run=RUN, gspo=GSPO), batch, 1.0),
                               timeout_s=300)[0]


def test_single_process_values(single):
    batch, scored = single
    assert scored.shape == (5, 16)
    assert bool((scored[~batch["response_mask"]] == 0).all())
    on = scored[batch["response_mask"]]
    assert bool((on < 0).all()) and bool(torch.isfinite(on).all())


@pytest.mark.slow
def test_every_rank_of_every_layout_has_the_single_process_tensor(single):
    batch, reference = single
    layouts = ("CP2xDP2", "PP2xTP2")  # both world 4: one spawn runs them in turn
    cfgs = {name: tiny_config(LAYOUTS[name][1], run=RUN, gspo=GSPO) for name in layouts}
    results = run_on_ranks(4, scoring_worker.run_scores, (cfgs, batch, 1.0), timeout_s=300)
    for layout in layouts:
        for rank, by_layout in enumerate(results):
            scored = by_layout[layout]
            assert scored.shape == reference.shape
            assert (scored - reference).abs().max().item() < 1e-5, (layout, rank)
