"""Spawned-rank side of the layout-equivalence tests (importable for the spawn start method).

Each rank builds the tiny policy under one parallel layout, loads the same full weights (HF names),
runs one mini-batch through Megatron's schedule with a given loss, and returns, in HF coordinates,
the pieces of its gradients and of its updated weights; the test assembles and compares them.
"""

from __future__ import annotations


from megatron_gspo.hf import rank_pieces
from megatron_gspo.model import gpt as policy
from megatron_gspo import parallel
from megatron_gspo.config import config_from_dict
from megatron_gspo.train.rl_loss import count_sequences, make_gspo_loss_fn, make_log_prob_fn
from megatron_gspo.train.sft import nll_loss_fn
from megatron_gspo.train.train_step import build_train_state, forward_backward, global_unit_count
from megatron_gspo.train.batching import split_for_rank


def _one_minibatch(state, cfg, pg, mbs, loss_kind):
    if loss_kind == "sft":
        loss_fn = nll_loss_fn(cfg.model, pg)
        local_units = sum(float(mb["loss_mask"].sum()) for mb in mbs)
    elif loss_kind == "gspo":
        # log pi_old: this policy's own log-probs (recomputed by Megatron, forward only) plus a
        # fixed perturbation, so that ratios move away from 1 and some sequences are clipped.
        forward_backward(state, mbs, make_log_prob_fn(cfg.model, pg), num_units_global=1,
                         forward_only=True)
        for mb in mbs:
            if "old_log_probs" in mb:  # last pipeline stage only
                mb["old_log_probs"] = mb["old_log_probs"] + mb["old_log_prob_offset"]
        loss_fn = make_gspo_loss_fn(cfg.model, cfg.gspo, pg)
        local_units = sum(count_sequences(mb["response_mask"]) for mb in mbs)
    else:
        raise ValueError(loss_kind)
    n_global = global_unit_count(local_units, pg)
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    metrics = forward_backward(state, mbs, loss_fn, num_units_global=n_global)
    return metrics, n_global


def run_layout(rank, world_size, cfg_dict, hf_weights, batch, microbatch_counts, loss_kind,
               take_step=True):
    """For each micro-batch count: load the weights, one forward/backward (+ optimizer step)."""
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    state = build_train_state(gpt, cfg, pg)
    is_last_stage = pg.pp.rank() == pg.pp.size() - 1
    outputs = []
    for num_microbatches in microbatch_counts:
        policy.load_hf_weights(gpt, cfg.model, pg, hf_weights.__getitem__)
        state.optimizer.reload_model_params()  # the optimizer's copy follows the loaded weights
        mbs = split_for_rank(batch, pg.dp.rank(), pg.dp.size(), num_microbatches)
        metrics, n_global = _one_minibatch(state, cfg, pg, mbs, loss_kind)
        grads = {name: p.main_grad.detach().clone()
                 for name, p in state.model[0].module.named_parameters()}
        out = {
            "num_microbatches": num_microbatches,
            "loss_sum": sum(float(m["loss_sum"]) for m in metrics) if is_last_stage else None,
            "counts_loss": is_last_stage and pg.tp.rank() == 0 and pg.cp.rank() == 0,
            "num_units": n_global,
            "metrics": metrics,
            "grads": [(p, t.clone()) for p, t in
                      rank_pieces.local_hf_pieces(gpt, cfg.model, pg, tensors=grads)],
        }
        if take_step:
            update_ok, grad_norm, _ = state.optimizer.step()
            out.update(update_ok=update_ok, grad_norm=grad_norm,
                       weights=[(p, t.clone()) for p, t in
                                rank_pieces.local_hf_pieces(gpt, cfg.model, pg)])
        outputs.append(out)
    parallel.destroy_model_parallel()
    return outputs
