"""Issue 38, item 15: an update whose loss or gradient is not finite is stopped BEFORE Megatron's
optimizer applies it, on every rank alike, naming the term.

Megatron-Core's FP32Optimizer (the CPU's) applies any gradient: before the check, a NaN loss on
one data-parallel rank reached every parameter of both ranks through the DP all-reduce and Adam
(the parameters then NaN, ``update_successful`` True). Now ``train_step`` raises
``NonFiniteError`` on both ranks, and the parameters, Adam's moments and the LR schedule are
exactly those before the step. Two gloo ranks (DP2): the NaN is on rank 1's micro-batch only.
"""

from __future__ import annotations

import math

import pytest
import torch

from bench.spawn import run_on_ranks
from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.model import gpt as policy
from megatron_gspo.train.batching import split_for_rank
from megatron_gspo.train.finite_check import NonFiniteError
from megatron_gspo.train.sft import nll_loss_fn, sft_batch
from megatron_gspo.train.train_step import build_train_state, global_unit_count, train_step
from pipeline.scoring.tasks import PAD_ID, AdditionTask
from tests.distributed.layouts import tiny_config


def _microbatches(pg, step: int) -> list[dict]:
    task = AdditionTask(digits=2, seed=0)
    batch = sft_batch([(p.prompt_ids, p.answer_ids) for p in task.problems(step * 8, 8)], 16,
                      pad_id=PAD_ID)
    return split_for_rank(batch, pg.dp.rank(), pg.dp.size(), 1)


def _poisoned(loss_fn, case: str, rank: int):
    """``loss``: rank 1's loss (and so its gradient) NaN; ``gradient``: the loss finite, the
    gradient of the logits inf on rank 0 (a backward that overflows)."""
    def poisoned(logits, batch):
        if case == "gradient" and rank == 0:
            logits.register_hook(lambda grad: torch.full_like(grad, math.inf))
        loss, metrics = loss_fn(logits, batch)
        if case == "loss" and rank == 1:
            loss = loss * math.nan
        return loss, metrics
    return poisoned


def _state_of(gpt, state) -> dict:
    moments = {}
    for megatron_optimizer in getattr(state.optimizer, "chained_optimizers", [state.optimizer]):
        inner = megatron_optimizer.optimizer  # FP32Optimizer wraps torch's Adam
        for p in (p for group in inner.param_groups for p in group["params"]):
            for key, value in inner.state.get(p, {}).items():
                if torch.is_tensor(value):
                    moments[(id(p), key)] = value.detach().clone()
    return {"params": {n: p.detach().clone() for n, p in gpt.named_parameters()},
            "moments": moments, "scheduler_steps": state.scheduler.num_steps}


def _same(a: dict, b: dict) -> bool:
    return (a["scheduler_steps"] == b["scheduler_steps"]
            and a["params"].keys() == b["params"].keys()
            and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
            and a["moments"].keys() == b["moments"].keys()
            and all(torch.equal(a["moments"][k], b["moments"][k]) for k in a["moments"]))


def _worker(rank, world, cfg_dict, case):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=1)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=3)
    state = build_train_state(gpt, cfg, pg)
    loss_fn = nll_loss_fn(cfg.model, pg)

    def step(j, fn):
        mbs = _microbatches(pg, j)
        units = global_unit_count(sum(float(mb["loss_mask"].sum()) for mb in mbs), pg)
        return train_step(state, mbs, fn, num_units_global=units)

    first = step(0, loss_fn)  # a good update first: Adam's moments exist
    before = _state_of(gpt, state)
    try:
        step(1, _poisoned(loss_fn, case, rank))
        error = None
    except NonFiniteError as err:
        error = str(err)
    after = _state_of(gpt, state)
    finite = all(bool(torch.isfinite(p).all()) for p in gpt.parameters())
    parallel.destroy_model_parallel()
    return {"first_ok": bool(first["update_successful"]), "error": error,
            "moments": len(before["moments"]),
            "unchanged": _same(before, after), "finite": finite}


@pytest.mark.parametrize("case,said", [
    pytest.param("loss", "non-finite loss: the loss is NaN; the gradient is NaN", id="loss"),
    pytest.param("gradient", "non-finite gradient (the loss is finite): the gradient is ",
                 id="gradient"),
])
def test_a_non_finite_update_is_stopped_on_every_rank_before_the_optimizer(case, said):
    cfg = tiny_config({}, run={"num_steps": 4, "global_batch_size": 8, "micro_batch_size": 4},
                      optim={"optimizer": "adam", "lr": 1e-3, "clip_grad": 1.0})
    results = run_on_ranks(2, _worker, (cfg, case), timeout_s=600)
    for rank, result in enumerate(results):
        assert result["first_ok"] and result["moments"] > 0, rank
        assert result["error"] is not None, f"rank {rank}: the update was applied"
        assert result["error"].startswith(said), (rank, result["error"])
        assert "The update was not applied" in result["error"]
        assert result["unchanged"] and result["finite"], rank
    assert results[0]["error"] == results[1]["error"]  # one verdict, on every rank
