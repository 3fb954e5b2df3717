"""Memory options change where activations live, never the step: every activation-recompute mode,
uneven pipeline stages and the overlapped gradient reduction give the single-process gradients.

The tiny Qwen3-MoE policy (real Megatron-Core on gloo ranks) takes one mini-batch of 2 micro-batches
through Megatron's schedule and one Adam step, as in test_layouts.py; loss, every gradient and
every updated weight (assembled in Hugging Face coordinates) are compared with the single-process
run WITHOUT recompute: 1e-5 relative, fp32. Recompute modes: full (uniform and block) and
selective (core_attn, layernorm, moe); moe_act needs Transformer Engine's grouped experts and is
refused on CPU (tested in tests/unit/test_gpu_path.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from tests.distributed import memory_worker
from tests.distributed.layouts import assemble, max_rel_diff, random_hf_weights, tiny_config
from bench.spawn import run_on_ranks
from tests.distributed.test_layouts import _batch

TOLERANCE = 1e-5
NUM_MICROBATCHES = 2

RECOMPUTE = {
    "full_uniform_1": {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 1},
    "full_uniform_2": {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 2},
    "full_block_1": {"recompute_granularity": "full", "recompute_method": "block",
                     "recompute_num_layers": 1},
    "selective_core_attn": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "selective_layernorm": {"recompute_granularity": "selective", "recompute_modules": ["layernorm"]},
    "selective_moe": {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    "selective_all": {"recompute_granularity": "selective",
                      "recompute_modules": ["core_attn", "layernorm", "moe"]},
}


# Forward calls per micro-batch and layer of each counted submodule, by recompute mode: 2 where
# the mode recomputes it in the backward pass, 1 otherwise.
RECOMPUTED = {
    "full_uniform_1": {"core_attention": 2, "input_layernorm": 2, "experts": 2},
    "full_uniform_2": {"core_attention": 2, "input_layernorm": 2, "experts": 2},
    "full_block_1": None,  # only the first layer of the stage: checked separately
    "selective_core_attn": {"core_attention": 2, "input_layernorm": 1, "experts": 1},
    "selective_layernorm": {"core_attention": 1, "input_layernorm": 2, "experts": 1},
    "selective_moe": {"core_attention": 1, "input_layernorm": 1, "experts": 2},
    "selective_all": {"core_attention": 2, "input_layernorm": 2, "experts": 2},
}


def _run_variants(world: int, variants: dict, weights, batch) -> dict:
    """name -> (loss, grads, weights, forward calls of rank 0) assembled over the ranks."""
    per_rank = run_on_ranks(world, memory_worker.run_variants,
                            (variants, weights, batch, NUM_MICROBATCHES), timeout_s=600)
    out = {}
    for name, cfg in variants.items():
        results = [r[name] for r in per_rank]
        assert all(r["update_ok"] for r in results)
        shapes = hf_param_shapes(config_from_dict(cfg).model)
        loss = sum(r["loss_sum"] for r in results if r["counts_loss"]) / results[0]["num_units"]
        out[name] = (loss, assemble(results, "grads", shapes), assemble(results, "weights", shapes),
                     results[0]["forward_calls"])
    return out


def _assert_same_step(name, got, ref, weights):
    loss, grads, new_weights, _ = got
    ref_loss, ref_grads, ref_weights, _ = ref
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), (name, loss, ref_loss)
    bad = {n: max_rel_diff(grads[n], ref_grads[n]) for n in ref_grads
           if max_rel_diff(grads[n], ref_grads[n]) > TOLERANCE}
    assert not bad, f"{name}: gradients differ from the single-process run: {bad}"
    bad = {n: max_rel_diff(new_weights[n], ref_weights[n]) for n in ref_weights
           if max_rel_diff(new_weights[n], ref_weights[n]) > TOLERANCE}
    assert not bad, f"{name}: updated weights differ from the single-process run: {bad}"
    assert max(max_rel_diff(ref_weights[n], weights[n].double()) for n in ref_weights) > 1e-4


@pytest.fixture(scope="module")
def two_layer():
    """World 1 without recompute (the reference) and with every recompute mode, one spawn."""
    weights = random_hf_weights(tiny_config({})["model"])
    batch = _batch()
    variants = {"reference": tiny_config({})}
    variants.update({name: tiny_config({}, extra) for name, extra in RECOMPUTE.items()})
    return weights, batch, _run_variants(1, variants, weights, batch)


@pytest.mark.parametrize("mode", list(RECOMPUTE))
def test_recompute_single_process_matches_no_recompute(mode, two_layer):
    weights, _, runs = two_layer
    _assert_same_step(mode, runs[mode], runs["reference"], weights)
    # ... and the mode really recomputed what it names (2 layers x 2 micro-batches per pass)
    calls = runs[mode][3]
    per_pass = 2 * NUM_MICROBATCHES
    assert runs["reference"][3] == {k: per_pass for k in memory_worker.COUNTED}
    if RECOMPUTED[mode] is None:  # block, 1 layer: layer 0 of the stage runs twice, layer 1 once
        assert calls == {k: per_pass + NUM_MICROBATCHES for k in memory_worker.COUNTED}
    else:
        assert calls == {k: per_pass * n for k, n in RECOMPUTED[mode].items()}, (mode, calls)


def test_recompute_under_pipeline_and_data_parallel_layouts(two_layer):
    """PP2 (one layer per stage) and DP2 with full and selective recompute; DP2 also with the
    gradient reduction overlapped with the backward pass (parallel.overlap_grad_reduce)."""
    weights, batch, runs = two_layer
    pp = {f"pp2_{m}": tiny_config({"pipeline": 2}, RECOMPUTE[m])
          for m in ("full_uniform_1", "full_block_1", "selective_layernorm")}
    for name, got in _run_variants(2, pp, weights, batch).items():
        _assert_same_step(name, got, runs["reference"], weights)
    dp = {"dp2_selective_all": tiny_config({}, RECOMPUTE["selective_all"]),
          "dp2_overlap_grad_reduce": tiny_config({"overlap_grad_reduce": True}),
          "dp2_overlap_full_recompute": tiny_config({"overlap_grad_reduce": True},
                                                    RECOMPUTE["full_uniform_1"])}
    for name, got in _run_variants(2, dp, weights, batch).items():
        _assert_same_step(name, got, runs["reference"], weights)


def test_tensor_and_expert_parallel_with_recompute(two_layer):
    """TP2 x EP2 (sequence parallel: the saved activations are the local sequence shards)."""
    weights, batch, runs = two_layer
    base = {"tensor": 2, "sequence_parallel": True, "expert": 2, "expert_tensor": 1}
    variants = {f"tp2ep2_{m}": tiny_config(base, RECOMPUTE[m])
                for m in ("full_uniform_1", "selective_all")}
    for name, got in _run_variants(4, variants, weights, batch).items():
        _assert_same_step(name, got, runs["reference"], weights)


THREE_LAYERS = {"num_layers": 3}


def test_uneven_pipeline_stages_match_single_process():
    """3 layers on PP2: 2 + 1 and 1 + 2 (first / last stage set), also with full recompute of
    one layer per chunk; and DP2 x PP2 (4 ranks) with the 2 + 1 split."""
    weights = random_hf_weights(tiny_config({}, THREE_LAYERS)["model"], seed=5)
    batch = _batch(seed=3)
    (ref,) = _run_variants(1, {"reference": tiny_config({}, THREE_LAYERS)}, weights, batch).values()
    first2 = {"pipeline": 2, "num_layers_in_first_pipeline_stage": 2}
    last2 = {"pipeline": 2, "num_layers_in_last_pipeline_stage": 2}
    variants = {"first2": tiny_config(first2, THREE_LAYERS),
                "last2": tiny_config(last2, THREE_LAYERS),
                "first2_full_recompute": tiny_config(first2, {**THREE_LAYERS,
                                                              **RECOMPUTE["full_uniform_1"]})}
    for name, got in _run_variants(2, variants, weights, batch).items():
        _assert_same_step(name, got, ref, weights)
    for name, got in _run_variants(4, {"dp2_first2": tiny_config(first2, THREE_LAYERS)},
                                   weights, batch).items():
        _assert_same_step(name, got, ref, weights)


def test_three_layer_model_needs_uneven_stages_on_pp2():
    from megatron_gspo.config import ConfigError

    with pytest.raises(ConfigError, match="parallel.pipeline: 2 does not divide model.num_layers 3"):
        tiny_config({"pipeline": 2}, THREE_LAYERS)
    with pytest.raises(ConfigError, match="recompute_num_layers: 2 does not divide the \\[1\\]"):
        tiny_config({"pipeline": 2, "num_layers_in_first_pipeline_stage": 2},
                    {**THREE_LAYERS, **RECOMPUTE["full_uniform_2"]})
