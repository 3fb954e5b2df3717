"""Every parallel layout takes the same optimizer step as the single-process run.

The tiny Qwen3-MoE policy (real Megatron-Core modules on gloo) loads the same full weights under
each layout, runs one mini-batch of 2 micro-batches through Megatron's schedule with a masked
next-token loss, and takes one Adam step with gradient clipping. Loss, every gradient (after
Megatron's DDP / sequence-parallel / embedding reductions) and every updated weight are assembled
in Hugging Face coordinates and compared with the single-process run: 1e-5 relative, fp32.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import layout_worker
from tests.distributed.layouts import (LAYOUTS, assemble, max_rel_diff, random_hf_weights,
                                       tiny_config)
from bench.spawn import run_on_ranks
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes

NUM_MICROBATCHES = 2
TOLERANCE = 1e-5


def _batch(seed: int = 1, rows: int = 4, seq: int = 16, vocab: int = 250) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    mask = torch.rand(rows, seq, generator=gen) > 0.2
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).expand(rows, seq).contiguous(), "loss_mask": mask}


def _run(layout: str, weights, batch, model=None) -> tuple[float, dict, dict, float]:
    world, parallel = LAYOUTS[layout]
    cfg = tiny_config(parallel, model)
    results = [r[0] for r in run_on_ranks(world, layout_worker.run_layout,
                                          (cfg, weights, batch, [NUM_MICROBATCHES], "sft"),
                                          timeout_s=300)]
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    loss = sum(r["loss_sum"] for r in results if r["counts_loss"]) / results[0]["num_units"]
    assert all(r["update_ok"] for r in results)
    return (loss, assemble(results, "grads", shapes), assemble(results, "weights", shapes),
            results[0]["grad_norm"])


@pytest.fixture(scope="module")
def reference():
    weights = random_hf_weights(tiny_config({})["model"])
    batch = _batch()
    return weights, batch, _run("1", weights, batch)


def assert_same_step(layout: str, got: tuple, ref: tuple) -> None:
    """(loss, grads, new weights, grad norm) of ``layout`` equal the single process's ``ref``
    within TOLERANCE."""
    loss, grads, new_weights, grad_norm = got
    ref_loss, ref_grads, ref_weights, ref_norm = ref
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
    assert abs(grad_norm - ref_norm) <= TOLERANCE * ref_norm
    bad = {n: max_rel_diff(grads[n], ref_grads[n]) for n in ref_grads
           if max_rel_diff(grads[n], ref_grads[n]) > TOLERANCE}
    assert not bad, f"{layout}: gradients differ from the single-process run: {bad}"
    bad = {n: max_rel_diff(new_weights[n], ref_weights[n]) for n in ref_weights
           if max_rel_diff(new_weights[n], ref_weights[n]) > TOLERANCE}
    assert not bad, f"{layout}: updated weights differ from the single-process run: {bad}"


@pytest.mark.parametrize("layout", ["DP2", "TP2", "EP2", "PP2", "TP2xEP2", "TP2xEP2xETP2", "PP2xTP2"])
def test_one_step_matches_single_process(layout, reference):
    weights, batch, ref = reference
    assert_same_step(layout, _run(layout, weights, batch), ref)
    ref_weights = ref[2]
    # The step really moved the weights (the comparison above is not between two no-ops).
    moved = max(max_rel_diff(ref_weights[n], weights[n].double()) for n in ref_weights)
    assert moved > 1e-4


def test_tied_embeddings_under_pipeline_parallelism():
    """Tied input/output embeddings live on both pipeline stages and must stay one tensor."""
    tied = {"tie_word_embeddings": True}
    weights = random_hf_weights(tiny_config({}, tied)["model"], seed=7)
    batch = _batch(seed=2)
    ref_loss, ref_grads, ref_weights, _ = _run("1", weights, batch, tied)
    # assemble() has already checked that both stages' copies of the embedding agree
    loss, grads, new_weights, _ = _run("PP2", weights, batch, tied)
    assert "lm_head.weight" not in ref_grads
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss)
    for name in ref_grads:
        assert max_rel_diff(grads[name], ref_grads[name]) <= TOLERANCE, name
        assert max_rel_diff(new_weights[name], ref_weights[name]) <= TOLERANCE, name
