"""One GSPO optimizer step on packed / context-parallel batches equals the single-process padded run.

A mini-batch of 8 sequences of mixed lengths (1 to 259 tokens) is trained once as right-padded
rows in one process (the reference: full logits, Megatron's own layout) and then as packed
sequences under a token budget, balanced over data-parallel ranks, zigzag-split per sequence over
context-parallel ranks, with the output layer on response positions only, under
CP2, CP2xTP2 (+SP), CP2xEP2, CP2xPP2 and DP2 (world <= 4). Loss, every gradient and every
updated weight (one Adam step with clipping) must match to 1e-5 relative. The batch makes GSPO
clip some sequences on each side, and two sequences' responses lie entirely on one CP rank
(lengths 1 and 3, padded to 4: rank 0 holds positions {0, 3}, rank 1 {1, 2}).

Multi-turn batches (``pipeline.generation.multiturn``, docs/tools.md): 8 trajectories of 1 to 5 model turns
with tool outputs between them, whose ``response_mask`` has holes (the tool outputs are context,
not response), take the same step under DP2, TP2 (+SP), PP2, EP2 and CP2, packed, as in one
process; the holes matter (the same batch without them takes another
step), and the single-process run clips on both sides.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.train.batching import rl_batch
from tests.distributed import packed_worker
from tests.distributed.layouts import assemble, max_rel_diff, random_hf_weights, tiny_config
from bench.spawn import run_on_ranks

TOLERANCE = 1e-5
GSPO = {"variant": "gspo", "eps_low": 0.01, "eps_high": 0.01}
# (prompt tokens, response tokens): sequence lengths 1, 3, 16, 39, 62, 119, 259, 47
SHAPES = [(1, 1), (2, 2), (5, 12), (30, 10), (3, 60), (20, 100), (10, 250), (8, 40)]
SEQ = 260
# per-sequence shift of log pi_old: +- 0.05 puts s_i = exp(-+0.05) outside [0.99, 1.01]
SHIFT = [0.0, 0.05, -0.05, 0.05, -0.05, 0.0, 0.002, 0.05]
ADVANTAGES = [0.8, -1.1, 0.7, 1.3, -0.4, -0.9, 1.0, -0.6]

# name -> (world, parallel section, budget per rank or None, response-only logits)
RUNS = {
    "packed1": (1, {}, 300, False),
    "CP2": (2, {"context": 2}, 160, True),
    "CP2xTP2": (4, {"context": 2, "tensor": 2, "sequence_parallel": True}, 160, True),
    "CP2xEP2": (2, {"context": 2, "expert": 2}, 160, True),
    "CP2xPP2": (4, {"context": 2, "pipeline": 2}, 160, True),
    "DP2": (2, {}, 270, True),
    "CP2rows": (2, {"context": 2}, None, True),  # padded rows, zigzag-split (no packing)
}


def mixed_length_batch(seed: int = 11, vocab: int = 250) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (p,), generator=gen).tolist() for p, _ in SHAPES]
    outputs = [torch.randint(1, vocab, (r,), generator=gen).tolist() for _, r in SHAPES]
    lps = [[0.0] * len(o) for o in outputs]
    batch = rl_batch(prompts, outputs, lps, torch.tensor(ADVANTAGES), SEQ, 0)
    noise = 0.01 * torch.randn(batch["tokens"].shape, generator=gen)
    batch["old_log_prob_offset"] = torch.tensor(SHIFT)[:, None] + noise
    return batch


# Multi-turn trajectories: (prompt tokens, [model, tool, model, tool, ..., model] segment lengths)
MT_SHAPES = [(3, [5, 4, 6]), (10, [20, 30, 15, 8, 40]), (2, [1, 3, 2]), (25, [60]),
             (5, [30, 70, 50]), (4, [2, 2, 2, 2, 2, 2, 2, 2, 2]), (12, [100, 20, 60]),
             (6, [9, 9, 9])]
# name -> as RUNS: one of each kind of parallelism (their products are covered by RUNS above)
MT_RUNS = {**{k: RUNS[k] for k in ("CP2", "DP2")},
           "TP2": (2, {"tensor": 2, "sequence_parallel": True}, 270, True),
           "PP2": (2, {"pipeline": 2}, 270, True),
           "EP2": (2, {"expert": 2}, 270, True)}


def multiturn_batch(seed: int = 13, vocab: int = 250, holes: bool = True) -> dict:
    """``rl_batch`` of MT_SHAPES with output masks: 1 on model segments, 0 on tool segments
    (all 1 with ``holes`` False)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs, masks = [], [], []
    for p, segments in MT_SHAPES:
        prompts.append(torch.randint(1, vocab, (p,), generator=gen).tolist())
        outputs.append(torch.randint(1, vocab, (sum(segments),), generator=gen).tolist())
        masks.append([int(k % 2 == 0 or not holes) for k, n in enumerate(segments)
                      for _ in range(n)])
    lps = [[0.0] * len(o) for o in outputs]
    batch = rl_batch(prompts, outputs, lps, torch.tensor(ADVANTAGES), SEQ, 0, output_masks=masks)
    noise = 0.01 * torch.randn(batch["tokens"].shape, generator=gen)
    batch["old_log_prob_offset"] = torch.tensor(SHIFT)[:, None] + noise
    return batch


def _run(name, weights, batch, reference=False, runs=RUNS):
    if reference:
        world, section, budget, response_only = 1, {}, None, False
    else:
        world, section, budget, response_only = runs[name]
    cfg = tiny_config(section, gspo=GSPO)
    results = run_on_ranks(world, packed_worker.run_gspo_step,
                           (cfg, weights, batch, budget, 2, response_only), timeout_s=600)
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    loss = sum(r["loss_sum"] for r in results if r["counts_loss"]) / results[0]["num_units"]
    clipped = sum(float(m["clip_frac"]) * float(m["num_sequences"])
                  for r in results if r["counts_loss"] for m in r["metrics"])
    assert all(r["update_ok"] for r in results)
    return {"loss": loss, "num_units": results[0]["num_units"], "clipped": clipped,
            "grad_norm": float(results[0]["grad_norm"]),
            "num_microbatches": [r["num_microbatches"] for r in results],
            "tokens": [r["tokens_per_microbatch"] for r in results],
            "grads": assemble(results, "grads", shapes),
            "weights": assemble(results, "weights", shapes)}


def test_two_responses_lie_entirely_on_one_cp_rank():
    """Sequences 0 (1 response token) and 1 (2) sit on one CP rank each under CP2."""
    from megatron_gspo.train.batching import pack_micro_batch, response_counts

    batch = mixed_length_batch()
    counts = [response_counts(pack_micro_batch(batch, [0, 1], cp_rank=r, cp_size=2)).tolist()
              for r in range(2)]
    assert counts == [[1, 0], [0, 2]]


@pytest.fixture(scope="module")
def reference():
    weights = random_hf_weights(tiny_config({})["model"], seed=21)
    batch = mixed_length_batch()
    return weights, batch, _run(None, weights, batch, reference=True)


def test_reference_clips_on_both_sides(reference):
    _, _, ref = reference
    assert ref["num_units"] == len(SHAPES)
    assert 2 <= ref["clipped"] <= len(SHAPES) - 2


@pytest.mark.parametrize("name", list(RUNS))
def test_packed_step_matches_single_process_padded(name, reference):
    weights, batch, ref = reference
    run = _run(name, weights, batch)
    world, section, budget, _ = RUNS[name]
    if budget is not None:  # the budget is respected and every rank runs the same count
        assert len(set(run["num_microbatches"])) == 1
        cp = section.get("context", 1)
        assert max(t for per_rank in run["tokens"] for t in per_rank) <= budget
        assert sum(t for per_rank in run["tokens"] for t in per_rank) < world * 2 * SEQ * 4 // cp
    assert run["num_units"] == ref["num_units"]
    assert abs(run["clipped"] - ref["clipped"]) < 1e-6
    assert abs(run["loss"] - ref["loss"]) <= TOLERANCE * abs(ref["loss"])
    assert abs(run["grad_norm"] - ref["grad_norm"]) <= TOLERANCE * ref["grad_norm"]
    bad = {n: max_rel_diff(run["grads"][n], ref["grads"][n]) for n in ref["grads"]
           if max_rel_diff(run["grads"][n], ref["grads"][n]) > TOLERANCE}
    assert not bad, f"{name}: gradients differ from the single-process padded run: {bad}"
    bad = {n: max_rel_diff(run["weights"][n], ref["weights"][n]) for n in ref["weights"]
           if max_rel_diff(run["weights"][n], ref["weights"][n]) > TOLERANCE}
    assert not bad, f"{name}: updated weights differ from the single-process padded run: {bad}"
    moved = max(max_rel_diff(ref["weights"][n], weights[n].double()) for n in ref["weights"])
    assert moved > 1e-4


@pytest.fixture(scope="module")
def multiturn_reference():
    weights = random_hf_weights(tiny_config({})["model"], seed=23)
    batch = multiturn_batch()
    return weights, batch, _run(None, weights, batch, reference=True)


def test_multiturn_batch_has_holes_that_change_the_step(multiturn_reference):
    weights, batch, ref = multiturn_reference
    mask = batch["response_mask"]
    # row 1: prompt 10, then model 20 / tool 30 / model 15 / tool 8 / model 40
    assert mask[1].nonzero()[:, 0].tolist() == (list(range(9, 29)) + list(range(59, 74))
                                                + list(range(82, 122)))
    assert 2 <= ref["clipped"] <= len(MT_SHAPES) - 2
    flat = _run(None, weights, multiturn_batch(holes=False), reference=True)
    assert abs(flat["loss"] - ref["loss"]) > 1e-3 * abs(ref["loss"])


@pytest.mark.parametrize("name", list(MT_RUNS))
def test_multiturn_step_matches_single_process(name, multiturn_reference):
    weights, batch, ref = multiturn_reference
    run = _run(name, weights, batch, runs=MT_RUNS)
    assert run["num_units"] == ref["num_units"] == len(MT_SHAPES)
    assert abs(run["clipped"] - ref["clipped"]) < 1e-6
    assert abs(run["loss"] - ref["loss"]) <= TOLERANCE * abs(ref["loss"])
    assert abs(run["grad_norm"] - ref["grad_norm"]) <= TOLERANCE * ref["grad_norm"]
    for key in ("grads", "weights"):
        bad = {n: max_rel_diff(run[key][n], ref[key][n]) for n in ref[key]
               if max_rel_diff(run[key][n], ref[key][n]) > TOLERANCE}
        assert not bad, f"{name}: {key} differ from the single-process run: {bad}"
