"""GSPO gradients of the real Megatron policy are the same under every parallel layout.

One GSPO mini-batch (6 sequences, uneven response lengths, one padding row, ratios away from 1 so
that some sequences are clipped on each side) goes through Megatron's schedules with 1 and with 3
micro-batches. The gradient of every parameter, after Megatron's DDP / sequence-parallel /
embedding reductions, must equal the single-process gradient to 1e-5 relative. This checks the
scaling contract of ``train_step`` (N sequences over all ranks, Megatron's micro-batch and DP
factors undone) together with vocab-parallel log-probs and the pipeline schedules.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from tests.distributed import layout_worker
from tests.distributed.layouts import LAYOUTS, assemble, max_rel_diff, random_hf_weights, tiny_config
from bench.spawn import run_on_ranks

MICROBATCH_COUNTS = [1, 3]
TOLERANCE = 1e-5
GSPO = {"variant": "gspo", "eps_low": 0.01, "eps_high": 0.01}


def gspo_batch(seed: int = 3, rows: int = 6, seq: int = 16, vocab: int = 250) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    prompt_len = torch.randint(2, 6, (rows,), generator=gen)
    response_len = torch.tensor([1, 11, 5, 0, 8, 3])  # row 3 is padding (no response token)
    positions = torch.arange(seq).expand(rows, seq)
    response_mask = (positions >= prompt_len[:, None] - 1) & (
        positions < (prompt_len + response_len)[:, None] - 1)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": positions.contiguous(),
        "response_mask": response_mask,
        "advantages": torch.tensor([1.0, -0.7, 0.4, 0.0, -1.2, 0.9]),
        # per-token perturbation of log pi_old around the current policy
        "old_log_prob_offset": 0.05 * torch.randn(rows, seq, generator=gen),
    }


def _run(layout: str, weights, batch):
    world, parallel = LAYOUTS[layout]
    cfg = tiny_config(parallel, gspo=GSPO)
    per_rank = run_on_ranks(world, layout_worker.run_layout,
                            (cfg, weights, batch, MICROBATCH_COUNTS, "gspo", False), timeout_s=300)
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    runs = []
    for i, _ in enumerate(MICROBATCH_COUNTS):
        results = [r[i] for r in per_rank]
        loss = sum(r["loss_sum"] for r in results if r["counts_loss"]) / results[0]["num_units"]
        clipped = sum(float(m["clip_frac"]) * float(m["num_sequences"])
                      for r in results if r["counts_loss"] for m in r["metrics"])
        runs.append({"loss": loss, "num_units": results[0]["num_units"], "clipped": clipped,
                     "grads": assemble(results, "grads", shapes)})
    return runs


@pytest.fixture(scope="module")
def reference():
    weights = random_hf_weights(tiny_config({})["model"], seed=5)
    batch = gspo_batch()
    return weights, batch, _run("1", weights, batch)


def test_reference_exercises_clipping_and_padding(reference):
    _, _, runs = reference
    for run in runs:
        assert run["num_units"] == 5  # the padding row is not a sequence
        assert 1 <= run["clipped"] <= 4  # some, not all, sequences are cut
    # 1 and 3 micro-batches give the same gradient in one process as well
    for name, grad in runs[0]["grads"].items():
        assert max_rel_diff(runs[1]["grads"][name], grad) <= TOLERANCE, name


@pytest.mark.parametrize("layout", ["DP2", "TP2", "EP2", "PP2", "TP2xEP2", "DP2xPP2"])
def test_gspo_gradients_match_single_process(layout, reference):
    weights, batch, ref_runs = reference
    runs = _run(layout, weights, batch)
    for run, ref in zip(runs, ref_runs):
        assert run["num_units"] == ref["num_units"]
        assert abs(run["loss"] - ref["loss"]) <= TOLERANCE * abs(ref["loss"])
        bad = {n: max_rel_diff(run["grads"][n], ref["grads"][n]) for n in ref["grads"]
               if max_rel_diff(run["grads"][n], ref["grads"][n]) > TOLERANCE}
        assert not bad, f"{layout}: GSPO gradients differ from the single-process run: {bad}"
    nonzero = sum(float(g.abs().sum()) for g in ref_runs[0]["grads"].values())
    assert nonzero > 0
