"""Checkpoints: save after a step, load into a fresh model/optimizer, and continue exactly.

Also: a checkpoint written under one layout (EP2) loads under another (single process) with
identical weights, since dist_checkpointing stores global tensors.
"""

from __future__ import annotations

import torch

from megatron_gspo.hf import rank_pieces
from megatron_gspo.model import gpt as policy
from megatron_gspo import parallel
from megatron_gspo.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from megatron_gspo.train.sft import nll_loss_fn, sft_batch
from megatron_gspo.train.train_step import build_train_state, global_unit_count, train_step
from megatron_gspo.train.batching import split_for_rank
from pipeline.scoring.tasks import PAD_ID, AdditionTask
from tests.distributed.layouts import assemble, tiny_config
from bench.spawn import run_on_ranks


def _step(state, cfg, pg, step):
    task = AdditionTask(digits=2, seed=0)
    batch = sft_batch([(p.prompt_ids, p.answer_ids) for p in task.problems(step * 8, 8)], 16,
                      pad_id=PAD_ID)
    mbs = split_for_rank(batch, pg.dp.rank(), pg.dp.size(), 2)
    units = global_unit_count(sum(float(mb["loss_mask"].sum()) for mb in mbs), pg)
    train_step(state, mbs, nll_loss_fn(cfg.model, pg), num_units_global=units)


def _fresh(cfg, pg):
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=11)
    return gpt, build_train_state(gpt, cfg, pg)


def _save_resume_worker(rank, world, cfg_dict, run_dir):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    _step(state, cfg, pg, 0)
    save_checkpoint(run_dir, 1, state.model, state.optimizer, {"sampler": {"index": 8}})
    _step(state, cfg, pg, 1)
    _step(state, cfg, pg, 2)
    continuous = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]
    # a fresh model and optimizer (different initial weights), then resume from step 1
    gpt2, state2 = _fresh(cfg, pg)
    with torch.no_grad():
        for p in gpt2.parameters():
            p.add_(0.5)
    path = latest_checkpoint(run_dir)
    run_state = load_checkpoint(path, state2.model, state2.optimizer)
    at_step1 = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt2, cfg.model, pg)]
    _step(state2, cfg, pg, 1)
    _step(state2, cfg, pg, 2)
    resumed = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt2, cfg.model, pg)]
    parallel.destroy_model_parallel()
    return {"continuous": continuous, "resumed": resumed, "at_step1": at_step1,
            "run_state": run_state, "path": str(path)}


def _load_worker(rank, world, cfg_dict, path):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt, state = _fresh(cfg, pg)
    load_checkpoint(path, state.model, None, restore_rng=False)
    out = [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)]
    parallel.destroy_model_parallel()
    return {"weights": out}


def test_resume_continues_exactly_and_loads_under_another_layout(tmp_path):
    cfg = tiny_config({"expert": 2})
    shapes = hf_param_shapes(config_from_dict(cfg).model)
    results = run_on_ranks(2, _save_resume_worker, (cfg, str(tmp_path)), timeout_s=300)
    assert results[0]["run_state"] == {"step": 1, "sampler": {"index": 8}}
    assert results[0]["path"].endswith("step_000001")
    continuous = assemble(results, "continuous", shapes)
    resumed = assemble(results, "resumed", shapes)
    for name in shapes:
        assert torch.equal(continuous[name], resumed[name]), name
    # the same checkpoint under a single-process layout: identical weights
    at_step1 = assemble(results, "at_step1", shapes)
    single = run_on_ranks(1, _load_worker, (tiny_config({}), results[0]["path"]), timeout_s=300)
    loaded = assemble(single, "weights", shapes)
    for name in shapes:
        assert torch.equal(loaded[name], at_step1[name]), name
