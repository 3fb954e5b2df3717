"""The phases of a GSPO step besides the batch (``pipeline.sources`` makes that): the weight sync
and the parity check after it (every rank: collectives), and rank 0's evaluation and colocated
servers' memory release / resume. ``pipeline.step.loop.run`` calls them in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megatron_gspo.collectives import broadcast
from pipeline.generation.client import control, eval_seed, sampling_params
from pipeline.generation.version import WeightVersion, to_wire
from pipeline.sources.batch import score_groups
from pipeline.step.rank0 import run_on_rank0
from pipeline.weights.parity import ParityError
from pipeline.weights.push import WeightPushError

if TYPE_CHECKING:
    from pipeline.context import LoopContext, Trainer


def evaluate(ctx: LoopContext, step: int) -> dict:
    """Rank 0: mean reward and pass@1 (fraction of correct samples) over n samples per prompt."""
    cfg = ctx.cfg
    sampling = sampling_params(cfg.rollout, ctx.stop_token_ids)
    groups = ctx.generator.generate(ctx.eval_prompts, cfg.rollout.eval_samples_per_prompt,
                                    sampling, seed=eval_seed(cfg.run.seed),
                                    rid_prefix=f"eval{step}")
    rewards, _ = score_groups(ctx, ctx.eval_prompts, groups)
    r = torch.tensor(rewards, dtype=torch.float64)
    per_prompt = r.view(len(ctx.eval_prompts), -1).mean(1)
    se = float(per_prompt.std() / len(per_prompt) ** 0.5) if len(per_prompt) > 1 else 0.0
    # reward_se: the standard error of reward_mean over the prompts (each prompt's mean)
    out = {"eval/reward_mean": float(r.mean()), "eval/reward_se": se,
           "eval/pass_at_1": float((r >= 1.0).double().mean())}
    more = ctx.generator.metrics([x for group in groups for x in group])
    out.update({f"eval/{k}": more[k] for k in ("tool_calls/mean", "num_turns/mean",
                                               "tool_errors/mean") if k in more})
    return out


def release_servers(ctx: LoopContext) -> None:
    """Rank 0: every colocated server gives its memory back to training."""
    for url in ctx.server_urls:
        control(url, "/release_memory_occupation", {"tags": None}, timeout_s=120.0)


def resume_servers(ctx: LoopContext, tags: list[str]) -> None:
    """Rank 0: every colocated server takes the memory of ``tags`` back."""
    for url in ctx.server_urls:
        control(url, "/resume_memory_occupation", {"tags": tags}, timeout_s=120.0)


MAX_SYNC_ATTEMPTS = 3
"""Weight pushes tried in one sync when servers die during it (each retry has fewer servers)."""


def sync_weights(ctx: LoopContext, trainer: Trainer, version: WeightVersion) -> dict:
    """Every rank: the trainer's HF buckets, pushed to every rollout server by the pusher,
    labelled ``version`` (its wire label, ``pipeline.generation.version.to_wire``).

    With a server pool (``ctx.servers``, rank 0) the servers are checked first: the dead ones
    are dropped (and restarted in embedded mode, then included here: a restarted server gets
    these weights before it re-enters the router); a push that fails because a server died
    meanwhile is made again to the servers left. After the push the restarted ones are admitted
    and rank 0 waits, bounded, until the router lists every server healthy again
    (``ServerPool.readmitted``: ``router_readmit_s``, 0 when it did at once)."""
    pool = _sync_members(ctx)
    for attempt in range(MAX_SYNC_ATTEMPTS):
        try:
            stats = ctx.weights.push(trainer.hf_buckets(), to_wire(version))
        except WeightPushError:  # raised on every rank alike: all of them retry or none
            if pool is None or attempt + 1 == MAX_SYNC_ATTEMPTS:
                raise
            before, pool = pool, _sync_members(ctx)
            if pool["events"] == before["events"]:  # no server died: another failure
                raise
            continue
        if pool is None:
            return stats.metrics()
        # restarted servers into the router, then the router routing to every server again
        # (its health checks may have marked them unhealthy during the pause; bounded)
        def admit_and_wait() -> float:
            ctx.servers.admit()
            return ctx.servers.readmitted()

        waited = _pool_call(ctx, admit_and_wait)
        return {**stats.metrics(), "router_readmit_s": waited}
    raise AssertionError("unreachable")


def check_parity(ctx: LoopContext, trainer: Trainer, version: WeightVersion) -> dict:
    """Every rank, after a weight sync: the parity watchdog's ``parity/*`` metrics ({} without
    one). Past ``parity.max_gap_mean``: one more sync of the same weights, checked again; still
    past it: :class:`pipeline.weights.parity.ParityError` on every rank alike."""
    if ctx.parity is None:
        return {}
    first = _parity_once(ctx, trainer)
    if not first.failed:
        return first.metrics()
    if dist.get_rank() == 0:
        print(f"parity watchdog: {first.describe()}; syncing the weights again", flush=True)
    sync_weights(ctx, trainer, version)
    second = _parity_once(ctx, trainer)
    if second.failed:
        raise ParityError(f"{second.describe()}, also after syncing the weights again (before: "
                          f"{first.worst()[1]['mean']:.3g}); the servers do not serve the "
                          "trainer's policy - see docs/parity.md")
    return {**second.metrics(), "parity/resyncs": 1}


def _parity_once(ctx: LoopContext, trainer: Trainer):
    """Collective: rank 0 has every server score the probes, every rank compares (the trainer
    scores them: a collective). An error on rank 0 is raised on every rank, as its type."""
    try:
        served = run_on_rank0(ctx, lambda: ctx.parity.server_scores(
            ctx.server_urls, ctx.client, ctx.stop_token_ids))
    except Exception as err:  # noqa: BLE001 - raised again, with where it happened
        err.add_note("parity probes")
        raise
    return ctx.parity.compare(served, trainer)


def _pool_call(ctx: LoopContext, fn):
    """``fn()`` on rank 0, its result on every rank; an error there raised on every rank alike,
    as its type (``megatron_gspo.collectives.on_rank0``)."""
    try:
        return run_on_rank0(ctx, fn)
    except Exception as err:  # noqa: BLE001 - raised again, with where it happened
        err.add_note("rollout servers")
        raise


def _sync_members(ctx: LoopContext) -> Optional[dict]:
    """Collective: rank 0's pool check (None without a pool): ``{"members", "renewed",
    "events"}``; every rank's pusher then pushes to those members."""
    has_pool = broadcast(ctx.servers is not None if dist.get_rank() == 0 else None,
                          ctx.control_group)
    if not has_pool:
        return None

    def check() -> dict:
        members = ctx.servers.check()
        ctx.server_urls = list(members)  # colocated release / resume: the live ones
        return {"members": members, "renewed": ctx.servers.take_renewed(),
                "events": ctx.servers.events}
    pool = _pool_call(ctx, check)
    ctx.weights.set_servers(pool["members"], renewed=pool["renewed"])
    return pool


def server_metrics(ctx: LoopContext) -> dict:
    """Rank 0: ``rollout/servers_alive`` and ``rollout/server_restarts`` (none without a pool)."""
    return ctx.servers.metrics() if ctx.servers is not None else {}
