"""Spawned-rank side of tests/distributed/test_routing_replay.py (importable for spawn).

One process builds the tiny policy (layout-independent initialisation), installs the routing
hooks (``megatron_gspo.model.routing_replay``) and runs plain forwards of one batch: free
routing, replay of what was recorded, and the same after a change of one layer's router weights.
It returns logits, log-probs, the routers' own top-k and their gates (the dense ``probs`` the
router returns) per layer.
"""

from __future__ import annotations

import torch


def _forward(gpt, routing, pg, cfg, batch, *, replay=None):
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_gspo.model import gpt as policy
    from megatron_gspo.model.routing_replay import RoutingPass

    gates = {}
    hooks = [m.register_forward_hook(
        lambda mod, _inp, out: gates.__setitem__(int(mod.layer_number) - 1, out[0].detach().clone()))
        for m in gpt.modules() if isinstance(m, TopKRouter)]
    mb = dict(batch)
    if replay is not None:
        mb["replay_topk"] = replay
    hook = RoutingPass(routing, replay_key="replay_topk" if replay is not None else None,
                       capture_key="captured")
    try:
        with torch.no_grad():
            hook.before_forward(mb)
            logits = gpt(mb["tokens"], mb["position_ids"], None)
            hook.after_forward(mb)
            log_probs, _ = policy.token_log_probs(logits, mb["labels"], cfg.model, pg)
    finally:
        for h in hooks:
            h.remove()
    return {"logits": logits.clone(), "log_probs": log_probs.clone(),
            "topk": [t.clone() for t in mb["captured"]], "gates": gates}


def run_replay_equivalence(rank, world_size, cfg_dict, batch, perturbed_layer, scale):
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.model import gpt as policy
    from megatron_gspo.model.routing_replay import MoERouting

    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=cfg.run.seed)
    gpt.train()  # as the trainer runs every pass (no dropout in this model)
    routing = MoERouting(gpt, pg)
    free = _forward(gpt, routing, pg, cfg, batch)
    replayed = _forward(gpt, routing, pg, cfg, batch, replay=free["topk"])
    # routed_experts -> targets through the batch layout ([b, s, layers, k])
    b, s = batch["tokens"].shape
    routed = torch.stack([t.reshape(s, b, -1).transpose(0, 1) for t in free["topk"]], dim=2)
    from_batch = _forward(gpt, routing, pg, cfg, batch,
                          replay=routing.targets_from_batch(routed))
    router = [m for m in gpt.modules() if isinstance(m, TopKRouter)][perturbed_layer]
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.add_(scale * torch.randn(router.weight.shape, generator=gen))
    changed_free = _forward(gpt, routing, pg, cfg, batch)
    changed_replayed = _forward(gpt, routing, pg, cfg, batch, replay=free["topk"])
    parallel.destroy_model_parallel()
    return {"free": free, "replayed": replayed, "from_batch": from_batch,
            "changed_free": changed_free, "changed_replayed": changed_replayed}
