"""Routing volatility and the spread of the importance ratios over one RL step (docs/routing.md).

Both compare the old policy (the weights at the start of the step: the old-log-prob forward of
``RLTrainer``) with the policy after the step's last optimizer step (one forward-only pass over
the same micro-batches, ``gspo.routing_metrics``), on the RESPONSE positions of the rollout batch:
the positions t where ``response_mask`` is True, i.e. the input tokens whose outputs give the
log-probs of the response tokens (the last prompt token and every response token but the last).

* ``routing_change_frac_layer{L}``: the fraction of those tokens whose top-k expert SET at global
  layer L differs between the two forwards (the routers' own choices, also when the step
  replays routing); ``routing_change_frac``: the same over all (token, layer) pairs;
  ``routing_change_any_frac``: the fraction of tokens with a change in at least one layer;
* ``token_log_ratio_var``: the population variance of log w_it = lp_new - lp_old over all
  response tokens of the batch; ``seq_log_ratio_var``: that of log s_i = mean_t log w_it over its
  sequences (with their means ``token_log_ratio_mean``, ``seq_log_ratio_mean``).

Per micro-batch, counts and sums are reduced over the ranks that hold pieces of it (pipeline
stages for the layers, context-parallel ranks and, under sequence parallelism, tensor-parallel
ranks for the tokens); ``metric_reduction`` then pools the micro-batches of all data-parallel
ranks by their token / sequence counts (a variance from the pooled sums of squares, not a mean of
variances).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.parallel import collective_device
from megatron_gspo.train.batching import loss_rows


def expert_set_changed(old_NK: torch.Tensor, new_NK: torch.Tensor) -> torch.Tensor:
    """``[N]`` True where the set of the k experts differs (the order within a row is ignored)."""
    if old_NK.shape != new_NK.shape:
        raise ValueError(f"top-k tensors differ in shape: {tuple(old_NK.shape)} vs "
                         f"{tuple(new_NK.shape)}")
    return (old_NK.sort(dim=-1).values != new_NK.sort(dim=-1).values).any(dim=-1)


def log_ratio_stats(mb: dict, new_log_probs: torch.Tensor, cp_group) -> dict:
    """One micro-batch's ``token_log_ratio_*`` and ``seq_log_ratio_*`` (means and population
    variances, with ``num_tokens`` / ``num_sequences``), of whole sequences: per-sequence counts,
    sums and sums of squares are all-reduced over the context-parallel group. ``mb`` holds
    ``old_log_probs`` (the step's log pi_old) and ``response_mask``."""
    mask = loss_rows(mb, mb["response_mask"], fill_value=False).bool()
    x = loss_rows(mb, (new_log_probs - mb["old_log_probs"]).to(torch.float64))
    x = torch.where(mask, x, 0.0)
    sums = torch.stack([mask.sum(-1).to(torch.float64), x.sum(-1), (x * x).sum(-1)], dim=-1)
    if cp_group is not None and cp_group.size() > 1:
        dist.all_reduce(sums, group=cp_group)
    n_i = sums[:, 0]
    has = n_i > 0
    num_tokens, num_sequences = float(n_i.sum()), int(has.sum())
    out = {"num_tokens": num_tokens, "num_sequences": float(num_sequences),
           "token_log_ratio_mean": 0.0, "token_log_ratio_var": 0.0,
           "seq_log_ratio_mean": 0.0, "seq_log_ratio_var": 0.0}
    if num_tokens > 0:
        mean = float(sums[:, 1].sum()) / num_tokens
        out["token_log_ratio_mean"] = mean
        out["token_log_ratio_var"] = max(float(sums[:, 2].sum()) / num_tokens - mean * mean, 0.0)
        log_s = sums[has, 1] / n_i[has]
        out["seq_log_ratio_mean"] = float(log_s.mean())
        out["seq_log_ratio_var"] = float(((log_s - log_s.mean()) ** 2).mean())
    return out


def routing_change_metrics(microbatches: list[dict], routing, pg, num_layers: int, *,
                           old_key: str = "routing_old", new_key: str = "routing_new") -> list[dict]:
    """Per micro-batch ``routing_change_*`` metrics (and ``num_tokens``), the same on every rank
    of the micro-batch's pipeline / tensor / context-parallel groups.

    ``microbatches[j][old_key]`` / ``[new_key]``: this stage's routers' top-k ``[tokens, k]``
    (router layout, ``model.routing_replay.MoERouting``) of the two forwards. Collective over
    the pipeline, tensor- and context-parallel groups (three all-reduces)."""
    device = collective_device()
    num_mb = len(microbatches)
    counts = torch.zeros(num_mb, num_layers + 2, dtype=torch.float64)
    any_parts, masks = [], []
    for j, mb in enumerate(microbatches):
        mask = routing.router_layout(mb["response_mask"]).reshape(-1).bool().cpu()
        changed_any = torch.zeros_like(mask)
        for layer, old, new in zip(routing.layers, mb[old_key], mb[new_key]):
            changed = expert_set_changed(old.cpu(), new.cpu()) & mask
            counts[j, layer] = float(changed.sum())
            changed_any |= changed
        any_parts.append(changed_any)
        masks.append(mask)
    last_stage = pg.pp.rank() == pg.pp.size() - 1
    if pg.pp.size() > 1:  # a token changed in any layer: over the stages' layers
        flat = torch.cat(any_parts).to(torch.int32).to(device)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=pg.pp)
        any_parts = list(flat.cpu().bool().split([len(m) for m in masks]))
    if last_stage:  # tokens and any-layer changes once, the layers' counts from every stage
        for j in range(num_mb):
            counts[j, num_layers] = float(any_parts[j].sum())
            counts[j, num_layers + 1] = float(masks[j].sum())
    counts = counts.to(device)
    if pg.pp.size() > 1:
        dist.all_reduce(counts, group=pg.pp)
    if routing.sequence_parallel:  # disjoint token slices (without SP every TP rank has all)
        dist.all_reduce(counts, group=pg.tp)
    if pg.cp.size() > 1:
        dist.all_reduce(counts, group=pg.cp)
    counts = counts.cpu()
    out = []
    for j in range(num_mb):
        tokens = float(counts[j, num_layers + 1])
        denom = max(tokens, 1.0)
        m = {"num_tokens": tokens,
             "routing_change_frac": float(counts[j, :num_layers].sum()) / (denom * num_layers),
             "routing_change_any_frac": float(counts[j, num_layers]) / denom}
        for layer in range(num_layers):
            m[f"routing_change_frac_layer{layer}"] = float(counts[j, layer]) / denom
        out.append(m)
    return out
