"""Spawned-rank side of the packed / context-parallel GSPO step tests (importable for spawn).

Each rank builds the tiny policy under one layout, loads the same full weights, cuts the same
padded GSPO batch into its micro-batches (padded rows, zigzag rows under CP, or packed sequences
under a token budget), recomputes log pi_old with Megatron (forward only) and perturbs it by a
fixed per-token offset (so that ratios leave 1 and some sequences are clipped), counts N over
DP x CP, runs one GSPO forward/backward through Megatron's schedule with the per-sequence CP
all-reduce, takes one optimizer step, and returns its gradient and weight pieces in HF names.
"""

from __future__ import annotations

from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.loss.context_parallel import make_sequence_reduce
from megatron_gspo.loss.loss_scaling import global_num_sequences
from megatron_gspo.hf import rank_pieces
from megatron_gspo.model import gpt as policy
from megatron_gspo.train.batching import (add_logit_index, packed_micro_batches, response_counts,
                                          split_for_rank, split_rows_for_context_parallel)
from megatron_gspo.train.rl_loss import make_gspo_loss_fn, make_log_prob_fn
from megatron_gspo.train.train_step import build_train_state, forward_backward


def micro_batches(batch, pg, *, budget, num_microbatches, response_only):
    dp_rank, dp = pg.dp.rank(), pg.dp.size()
    cp_rank, cp, tp = pg.cp.rank(), pg.cp.size(), pg.tp.size()
    if budget is None:
        mbs = [split_rows_for_context_parallel(mb, cp_rank, cp, tp)
               for mb in split_for_rank(batch, dp_rank, dp, num_microbatches)]
    else:
        mbs = packed_micro_batches(batch, budget, dp_rank=dp_rank, dp_size=dp, cp_rank=cp_rank,
                                   cp_size=cp, tp_size=tp)
    return [add_logit_index(mb) if response_only else mb for mb in mbs]


def run_gspo_step(rank, world_size, cfg_dict, hf_weights, batch, budget, num_microbatches,
                  response_only):
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    state = build_train_state(gpt, cfg, pg)
    policy.load_hf_weights(gpt, cfg.model, pg, hf_weights.__getitem__)
    state.optimizer.reload_model_params()
    mbs = micro_batches(batch, pg, budget=budget, num_microbatches=num_microbatches,
                        response_only=response_only)
    forward_backward(state, mbs, make_log_prob_fn(cfg.model, pg), num_units_global=1,
                     forward_only=True)
    for mb in mbs:
        if "old_log_probs" in mb:  # last pipeline stage only
            mb["old_log_probs"] = mb["old_log_probs"] + mb["old_log_prob_offset"]
    n_global = global_num_sequences([response_counts(mb) for mb in mbs], dp_group=pg.dp,
                                    cp_group=pg.cp)
    loss_fn = make_gspo_loss_fn(cfg.model, cfg.gspo, pg, sequence_reduce=make_sequence_reduce(pg.cp))
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    metrics = forward_backward(state, mbs, loss_fn, num_units_global=n_global)
    grads = {name: p.main_grad.detach().clone() for name, p in state.model[0].module.named_parameters()}
    is_last_stage = pg.pp.rank() == pg.pp.size() - 1
    out = {
        "num_microbatches": len(mbs),
        "tokens_per_microbatch": [int(mb["tokens"].numel()) for mb in mbs],
        "loss_sum": sum(float(m["loss_sum"]) for m in metrics) if is_last_stage else None,
        "counts_loss": is_last_stage and pg.tp.rank() == 0 and pg.cp.rank() == 0,
        "num_units": n_global,
        "metrics": metrics,
        "grads": [(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg, tensors=grads)],
    }
    update_ok, grad_norm, _ = state.optimizer.step()
    out.update(update_ok=update_ok, grad_norm=grad_norm,
               weights=[(p, t.clone()) for p, t in rank_pieces.local_hf_pieces(gpt, cfg.model, pg)])
    parallel.destroy_model_parallel()
    return out
