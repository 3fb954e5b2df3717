"""The learning-rate schedule: Megatron's OptimizerParamScheduler as built by ``build_train_state``.

Real optimizer steps (``train_step`` on the tiny policy, one gloo rank) report the LR each step
used, read back from the optimizer's parameter groups; it must follow the closed form written here
(warmup then constant / linear / cosine decay to min_lr over the run's optimizer steps) within
1e-12. A checkpoint taken mid-run and loaded into a fresh model, optimizer and scheduler continues
with exactly the LRs and weights of the uninterrupted run.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.model import gpt as policy
from megatron_gspo.train.batching import split_for_rank
from megatron_gspo.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from megatron_gspo.train.sft import nll_loss_fn, sft_batch
from megatron_gspo.train.train_step import build_train_state, global_unit_count, train_step
from pipeline.scoring.tasks import PAD_ID, AdditionTask
from tests.distributed.layouts import tiny_config
from bench.spawn import run_on_ranks

PEAK, FLOOR = 2e-3, 1e-4


def expected_lr(j: int, *, warmup: int, total: int, style: str, peak=PEAK, floor=FLOOR) -> float:
    """Optimizer step j (from 0): linear warmup from 0 over ``warmup`` steps, then the decay that
    would reach ``floor`` at step ``total`` (``floor`` is 0 for constant)."""
    if warmup > 0 and j <= warmup:
        return peak * j / warmup
    if style == "constant":
        return peak
    progress = (j - warmup) / (total - warmup)
    shape = 1.0 - progress if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + shape * (peak - floor)


def _step(state, cfg, pg, step):
    task = AdditionTask(digits=2, seed=0)
    batch = sft_batch([(p.prompt_ids, p.answer_ids) for p in task.problems(step * 4, 4)], 16,
                      pad_id=PAD_ID)
    mbs = split_for_rank(batch, pg.dp.rank(), pg.dp.size(), 1)
    units = global_unit_count(sum(float(mb["loss_mask"].sum()) for mb in mbs), pg)
    return train_step(state, mbs, nll_loss_fn(cfg.model, pg), num_units_global=units)


def _fresh(cfg, pg, updates_per_step, seed=11):
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=seed)
    return gpt, build_train_state(gpt, cfg, pg, updates_per_step=updates_per_step)


def _schedule_worker(rank, world, cfg_dicts, updates_per_step, run_dir, resume_after):
    out = {}
    for name, cfg_dict in cfg_dicts.items():
        cfg = config_from_dict(cfg_dict)
        pg = parallel.initialize(cfg.parallel, seed=1)
        total = cfg.run.num_steps * updates_per_step
        gpt, state = _fresh(cfg, pg, updates_per_step)
        lrs, group_lrs = [], []
        for j in range(total):
            if name == "cosine" and j == resume_after:
                save_checkpoint(f"{run_dir}/{name}", j, state.model, state.optimizer, {},
                                scheduler=state.scheduler)
            group_lrs.append(sorted({g["lr"] for g in state.optimizer.param_groups}))  # the step's
            result = _step(state, cfg, pg, j)
            assert result["update_successful"]
            lrs.append(result["lr"])
        out[name] = {"lrs": lrs, "group_lrs": group_lrs, "total": total,
                     "scheduler_steps": state.scheduler.num_steps}
        if name == "cosine":
            continuous = {n: p.detach().clone() for n, p in gpt.named_parameters()}
            # a fresh model, optimizer and scheduler (other weights), resumed mid-run
            gpt2, state2 = _fresh(cfg, pg, updates_per_step, seed=99)
            load_checkpoint(latest_checkpoint(f"{run_dir}/{name}"), state2.model, state2.optimizer,
                            scheduler=state2.scheduler)
            resumed_lrs = [_step(state2, cfg, pg, j)["lr"] for j in range(resume_after, total)]
            out["resumed"] = {
                "lrs": resumed_lrs,
                "weights_equal": all(torch.equal(p, continuous[n]) for n, p in gpt2.named_parameters()),
            }
        parallel.destroy_model_parallel()
    return out


def test_lr_follows_warmup_and_decay_and_resumes_exactly(tmp_path):
    k, warmup_run_steps, num_steps = 2, 2, 5   # RL-like: 2 updates per run step
    configs = {}
    for style, warmup, floor in (("cosine", warmup_run_steps, FLOOR), ("linear", warmup_run_steps, FLOOR),
                                 ("constant", warmup_run_steps, 0.0), ("constant_no_warmup", 0, 0.0)):
        configs[style] = tiny_config(
            {}, optim={"optimizer": "adam", "lr": PEAK, "min_lr": floor, "adam_eps": 1e-4,
                       "lr_decay_style": style.split("_")[0], "warmup_steps": warmup},
            run={"num_steps": num_steps, "global_batch_size": 8, "micro_batch_size": 4})
    resume_after = 5  # optimizer steps before the checkpoint: inside the cosine decay
    result = run_on_ranks(1, _schedule_worker, (configs, k, str(tmp_path), resume_after),
                          timeout_s=600)[0]
    for style in configs:
        warmup = 0 if style == "constant_no_warmup" else warmup_run_steps * k
        got = result[style]
        assert got["total"] == num_steps * k == got["scheduler_steps"]
        want = [expected_lr(j, warmup=warmup, total=got["total"], style=style.split("_")[0],
                            floor=FLOOR if style in ("cosine", "linear") else 0.0)
                for j in range(got["total"])]
        assert max(abs(a - b) for a, b in zip(got["lrs"], want)) <= 1e-12, (style, got["lrs"], want)
        # every parameter group (dense and expert, with and without weight decay) uses that lr
        assert all(groups == [lr] for groups, lr in zip(got["group_lrs"], got["lrs"])), style
    cosine = result["cosine"]["lrs"]
    assert cosine[0] == 0.0 and cosine[warmup_run_steps * k] == PEAK and cosine[-1] > FLOOR
    assert len(set(cosine)) == len(cosine)  # it really moves every step
    # resume: the LRs and the weights of the uninterrupted run, exactly
    assert result["resumed"]["lrs"] == cosine[resume_after:]
    assert result["resumed"]["weights_equal"]


@pytest.mark.parametrize("data,pattern", [
    ({"optim": {"warmup_steps": 5}, "run": {"num_steps": 5}}, r"optim\.warmup_steps: 5 must be <"),
    ({"optim": {"min_lr": 2e-6, "lr": 1e-6}}, r"optim\.min_lr: must be in \[0, optim\.lr\]"),
])
def test_schedules_megatron_would_assert_on_are_config_errors(data, pattern):
    from megatron_gspo.config import ConfigError

    with pytest.raises(ConfigError, match=pattern):
        config_from_dict(data)
