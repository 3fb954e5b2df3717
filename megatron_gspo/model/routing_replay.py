"""Routing replay and routing capture on Megatron-Core's ``RouterReplay`` (docs/routing.md).

Megatron-Core 0.16.1 routes every top-k selection of a ``TopKRouter`` through
``RouterReplay.get_replay_topk`` when the router holds a ``RouterReplay`` (what the config flag
``moe_enable_routing_replay`` creates): action ``RECORD`` keeps the router's top-k indices,
``REPLAY_FORWARD`` uses the indices given by ``set_target_indices`` instead (the gates are the
router's scores gathered at them, so gradients still reach the router), ``None`` routes normally.

:func:`install` gives each router of a policy chunk a :class:`CapturingRouterReplay`, that class
with two accommodations:

* it always computes and keeps the router's OWN top-k (``computed``), also while replaying: the
  routing-change metrics compare what the routers choose, whatever a pass replays;
* under ``REPLAY_FORWARD`` a token whose target row holds a negative index (-1: unknown, e.g.
  padding of the rollout servers' ``routed_experts``) is routed by the router itself.

It is not registered in ``RouterReplay.global_router_replay_instances``: the targets are set per
router and per micro-batch (:class:`RoutingPass`, called by ``train_step.forward_step`` right
before and after each micro-batch's forward on this pipeline stage), so several models in one
process (the frozen reference policy, tests) do not share a global list.

Router layout. A router sees this rank's tokens of the micro-batch as ``[s, b]`` flattened
row-major (``n = t * b + row``), ``s`` this rank's positions (its context-parallel share; under
sequence parallelism only its ``s / tp`` slice of them). :meth:`MoERouting.router_layout` maps a
per-token tensor of the micro-batch (``[b, s, ...]``) to that layout. Activation recompute that
re-runs the router is refused with replay (``config.validate_routing_replay``).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction


class CapturingRouterReplay(RouterReplay):
    """Megatron's ``RouterReplay`` that also keeps the router's own top-k (module docstring)."""

    def __init__(self):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.computed: Optional[torch.Tensor] = None
        """``[tokens, k]``: the router's own top-k indices of the last forward."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, computed = default_compute_topk(scores, topk, num_groups=num_groups,
                                               group_topk=group_topk)
        self.computed = computed.detach()
        action = self.router_replay_action
        if action == RouterReplayAction.RECORD:
            self.record_indices(self.computed)
            return probs, computed
        if action not in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            return probs, computed
        target = (self.target_topk_idx if action == RouterReplayAction.REPLAY_FORWARD
                  else self.replay_backward_list.pop(0))
        if target is None:
            raise RuntimeError("routing replay: no target experts were set for this router")
        target = target.to(device=scores.device, dtype=torch.long)
        if tuple(target.shape) != tuple(computed.shape):
            raise ValueError(f"routing replay: target experts of shape {tuple(target.shape)} for "
                             f"a router that routes {tuple(computed.shape)} (tokens, top-k)")
        unknown = (target < 0).any(dim=-1, keepdim=True)
        indices = torch.where(unknown, computed, target)
        return scores.gather(1, indices), indices


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


class MoERouting:
    """The MoE routers of one policy chunk: replay targets in, own top-k choices out."""

    def __init__(self, gpt, pg_collection):
        gpt = _unwrap(gpt)
        self.routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
        for router in self.routers:
            if not isinstance(router.router_replay, CapturingRouterReplay):
                router.router_replay = CapturingRouterReplay()
        self.layers = [int(r.layer_number) - 1 for r in self.routers]
        """Global 0-based layer index of each local router (HF's ``model.layers.{L}``)."""
        if self.layers != sorted(set(self.layers)):
            raise RuntimeError(f"MoE routers out of layer order: {self.layers}")
        self.topk = gpt.config.moe_router_topk
        self.num_experts = gpt.config.num_moe_experts
        self.tp = pg_collection.tp
        self.sequence_parallel = bool(gpt.config.sequence_parallel) and self.tp.size() > 1

    def router_layout(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[b, s, ...]`` values of this rank's micro-batch -> ``[tokens, ...]`` in the order this
        rank's routers see the tokens (``[s, b]`` row-major; the SP slice under sequence
        parallelism)."""
        x = per_token.transpose(0, 1)
        if self.sequence_parallel:
            s = x.shape[0]
            if s % self.tp.size() != 0:
                raise ValueError(f"{s} positions do not split over {self.tp.size()} "
                                 "sequence-parallel ranks")
            shard = s // self.tp.size()
            x = x[self.tp.rank() * shard:(self.tp.rank() + 1) * shard]
        return x.reshape(-1, *x.shape[2:])

    def targets_from_batch(self, routed_experts: torch.Tensor) -> list[torch.Tensor]:
        """Per local router, ``[tokens, k]`` targets from a micro-batch's ``routed_experts``
        (``[b, s, num_layers, k]``, global layers)."""
        return [self.router_layout(routed_experts[:, :, layer]).contiguous()
                for layer in self.layers]

    def set_replay(self, targets: Optional[list[torch.Tensor]]) -> None:
        """Replay ``targets`` (one per local router) in the next forward; None: route freely."""
        if targets is not None and len(targets) != len(self.routers):
            raise ValueError(f"routing replay: {len(targets)} target tensors for "
                             f"{len(self.routers)} local MoE layers")
        for i, router in enumerate(self.routers):
            replay = router.router_replay
            replay.clear_indices()
            if targets is None:
                replay.clear_router_replay_action()
            else:
                replay.set_target_indices(targets[i])
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def computed(self) -> list[torch.Tensor]:
        """Per local router, its own top-k of the last forward, ``[tokens, k]``."""
        out = [r.router_replay.computed for r in self.routers]
        if any(c is None for c in out):
            raise RuntimeError("routing capture: a router did not run in the last forward")
        return out

    def reset(self) -> None:
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()
            router.router_replay.computed = None


class RoutingPass:
    """What one pass over micro-batches does with the routers, per micro-batch (the hooks
    ``train_step.forward_step`` calls around each forward): replay ``mb[replay_key]`` (a list of
    per-router targets) when given, and store the routers' own top-k in ``mb[capture_key]``."""

    def __init__(self, routing: MoERouting, *, replay_key: Optional[str] = None,
                 capture_key: Optional[str] = None):
        self.routing = routing
        self.replay_key = replay_key
        self.capture_key = capture_key

    def before_forward(self, mb: dict) -> None:
        targets = None
        if self.replay_key is not None:
            if self.replay_key not in mb:
                raise KeyError(f"routing replay: micro-batch has no {self.replay_key!r}")
            targets = mb[self.replay_key]
        self.routing.set_replay(targets)

    def after_forward(self, mb: dict) -> None:
        if self.capture_key is not None:
            mb[self.capture_key] = self.routing.computed()
        self.routing.reset()
