"""The phases of a GSPO step (rank 0 unless said otherwise): rollout, scoring and the batch;
the stream's batch (``rollout.async: full``); evaluation; the colocated servers' memory; the weight
sync and the parity check after it (every rank). ``pipeline.step.loop.run`` calls them in order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from megatron_gspo.config import Config
from megatron_gspo.loss.advantages import group_advantages, is_zero_std_group
from megatron_gspo.train.batching import rl_batch
from pipeline.generation.version import WeightVersion, to_wire
from pipeline.step.rank0 import broadcast, run_on_rank0

if TYPE_CHECKING:
    from pipeline.scoring.data import Prompt
    from pipeline.step.loop import LoopContext, Trainer
    from pipeline.generation.client import RolloutResult

MAX_DYNAMIC_SAMPLING_ROUNDS = 8
"""Extra rounds of prompts dynamic sampling may draw in one step before it tops the batch up
with zero-std groups."""


def rollout_phase(ctx: LoopContext, step: int) -> tuple[dict, dict]:
    """Rank 0: prompts -> samples -> rewards -> advantages -> the training batch and metrics."""
    cfg = ctx.cfg
    num_prompts = cfg.run.global_batch_size // cfg.gspo.group_size
    start = time.monotonic()
    prompts = ctx.sampler.next_batch(num_prompts)
    groups = _generate_groups(ctx, prompts, step, 0)
    rewards, failures = _score(ctx, prompts, groups)
    metrics: dict[str, float] = reward_metrics(rewards, cfg.gspo.group_size)
    if cfg.gspo.dynamic_sampling:
        zero_std = is_zero_std_group(torch.tensor(rewards, dtype=torch.float64), cfg.gspo.group_size)
        prompts, groups, rewards, rounds = _fill_with_informative_groups(
            ctx, step, prompts, groups, rewards, zero_std, num_prompts)
        metrics["dynamic_sampling_rounds"] = rounds
    gen_s = time.monotonic() - start
    batch, more = build_batch(ctx, step, prompts, groups, rewards)
    metrics.update(more)
    metrics.update({
        "reward_failures": failures,
        "rollout_s": gen_s,
        "rollout_tokens_per_s": more["response_tokens"] / max(gen_s, 1e-9),
    })
    return batch, metrics


def build_batch(ctx: LoopContext, step: int, prompts: list[Prompt],
                groups: list[list[RolloutResult]], rewards: list[float]) -> tuple[dict, dict]:
    """Rank 0: the training batch of step ``step`` from its groups (prompt-major) and rewards:
    advantages, padded rows, the routed experts with routing replay; and its sample metrics."""
    cfg = ctx.cfg
    outputs = [list(r.output_ids) for group in groups for r in group]
    logprobs = [list(r.output_logprobs) for group in groups for r in group]
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), cfg.gspo.group_size,
                                  normalize_std=cfg.gspo.normalize_std,
                                  leave_one_out=cfg.gspo.leave_one_out)
    from pipeline.scoring.tasks import PAD_ID

    results = [r for group in groups for r in group]
    # the sample's own prompt: an environment's reset() may differ from the dataset's
    prompt_ids = [list(r.prompt_ids) for r in results]
    batch = rl_batch(prompt_ids, outputs, logprobs, advantages, cfg.run.seq_length, PAD_ID,
                     output_masks=[r.output_mask for r in results])
    shape = _routed_experts_shape(cfg)
    if shape is not None:  # routing replay "rollout": the experts the servers routed each token to
        from pipeline.generation.routed_experts import batch_routed_experts

        batch["routed_experts"] = batch_routed_experts(
            prompt_ids, outputs, [r.routed_experts for group in groups for r in group],
            cfg.run.seq_length, *shape)
    lengths = torch.tensor([len(o) for o in outputs], dtype=torch.float64)
    finish = [r.finish_reason for group in groups for r in group]
    metrics = staleness_metrics([r for group in groups for r in group], trained=step - 1)
    metrics.update({
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "response_tokens": float(lengths.sum()),
        "truncated_frac": sum(f == "length" for f in finish) / len(finish),
    })
    metrics.update(ctx.generator.metrics(results))
    return batch, metrics


def reward_metrics(rewards: Sequence[float], group_size: int) -> dict[str, float]:
    """The batch's reward mean and spread and its share of groups whose rewards are all equal."""
    all_rewards = torch.tensor(list(rewards), dtype=torch.float64)
    zero_std = is_zero_std_group(all_rewards, group_size)
    return {"zero_std_group_frac": float(zero_std.float().mean()),
            "reward_mean": float(all_rewards.mean()),
            "reward_std": float(all_rewards.std(unbiased=False))}


def stream_batch(ctx: LoopContext, stream: Any, step: int) -> tuple[dict, dict]:
    """Rank 0, ``rollout.async: full``: step ``step``'s batch from the stream's oldest complete
    groups (``pipeline.sources.stream``); ``rollout_s`` is how long the trainer waited for them."""
    import copy

    from pipeline.sources.stream import step_metrics

    t0 = time.monotonic()
    before = copy.deepcopy(stream.counts)
    chosen = stream.take(step)
    waited = time.monotonic() - t0
    prompts = [g.prompt for g in chosen]
    groups = [list(g.results) for g in chosen]
    rewards = [x for g in chosen for x in g.rewards]
    metrics = reward_metrics(rewards, ctx.cfg.gspo.group_size)
    batch, more = build_batch(ctx, step, prompts, groups, rewards)
    metrics.update(more)
    metrics.update(step_metrics(before, stream.counts))
    metrics.update(stream.snapshot())
    metrics.update({"reward_failures": sum(g.failures for g in chosen), "rollout_s": waited,
                    "admitted_version_min": float(min(g.admitted_version for g in chosen))})
    return batch, metrics


def make_stream(ctx: LoopContext, start_step: int) -> Any:
    """Rank 0, ``rollout.async: full``: the rollout stream of this run (not started)."""
    from pipeline.generation.client import sampling_params
    from pipeline.sources.stream import RolloutStream, group_seed

    cfg = ctx.cfg
    G = cfg.gspo.group_size
    shape = _routed_experts_shape(cfg)
    sampling = sampling_params(cfg.rollout, ctx.stop_token_ids)
    can_continue = ctx.generator.can_continue()

    async def generate(prompt: Prompt, seed: int, rid_prefix: str) -> list:
        groups = await ctx.generator.generate_async([prompt], G, sampling, seed=seed,
                                                    rid_prefix=rid_prefix, routed_experts=shape)
        return groups[0]

    async def resume(prompt: Prompt, seed: int, rid_prefix: str, partial: list) -> list:
        return await ctx.generator.continue_group(prompt, partial, sampling, seed=seed,
                                                  rid_prefix=rid_prefix, routed_experts=shape)

    def score(prompt: Prompt, results: list) -> tuple[list[float], int]:
        return _score(ctx, [prompt], [results])

    def informative(group) -> bool:  # dynamic sampling: all rewards equal carry no gradient
        return not bool(is_zero_std_group(torch.tensor(group.rewards, dtype=torch.float64), G)[0])
    stream = RolloutStream(
        generate=generate, score=score, draw=lambda: ctx.sampler.next_batch(1)[0],
        prompts_per_step=cfg.run.global_batch_size // G,
        max_staleness=cfg.rollout.max_staleness, version=start_step, taken=start_step,
        seed_of=lambda index, attempt: group_seed(cfg.run.seed, index, attempt),
        keep=informative if cfg.gspo.dynamic_sampling else None,
        # samples in flight at a checkpoint are continued from their output so far when the
        # generator can (single turn); multi-turn trajectories are generated again (docs/async.md)
        abort=ctx.generator.abort_all if can_continue else None,
        resume=resume if can_continue else None,
        timeout_s=60.0 * cfg.parallel.control_timeout_minutes)
    if ctx.rollout_stream is not None:
        stream.restore(ctx.rollout_stream)
    return stream


def staleness_metrics(results: Sequence[RolloutResult], trained: WeightVersion
                      ) -> dict[str, float]:
    """Per-token staleness of a batch: versions between the policy that generated each output
    token (``meta_info.weight_versions``; the loop labels the weights after step k with ``k``)
    and the policy being trained (``trained``: the weights at the start of the step). Tokens
    whose version is not a step number (a server's initial label) are not counted."""
    ages = []
    for r in results:
        for version, start, end in r.weight_versions:
            if version is not None:
                ages += [trained - version] * (end - start)
    if not ages:
        return {}
    t = torch.tensor(ages, dtype=torch.float64)
    out = {"staleness_mean": float(t.mean()), "staleness_max": float(t.max())}
    for k in range(3):  # the histogram's first bins: fraction of tokens k versions old
        out[f"staleness_frac_{k}"] = float((t == k).double().mean())
    out["staleness_frac_3plus"] = float((t >= 3).double().mean())
    return out


def _routed_experts_shape(cfg: Config) -> Optional[tuple[int, int]]:
    """(layers, top-k) of the routed experts the training rollouts ask the servers for: with
    ``gspo.routing_replay: rollout`` only (evaluation never asks)."""
    if cfg.gspo.routing_replay != "rollout":
        return None
    return cfg.model.num_layers, cfg.model.moe_router_topk


def _generate_groups(ctx: LoopContext, prompts: list[Prompt], step: int,
                     round_: int) -> list[list[RolloutResult]]:
    from pipeline.generation.client import rollout_seed, sampling_params

    cfg = ctx.cfg
    sampling = sampling_params(cfg.rollout, ctx.stop_token_ids)
    return ctx.generator.generate(prompts, cfg.gspo.group_size, sampling,
                                  seed=rollout_seed(cfg.run.seed, step, round_),
                                  rid_prefix=f"s{step}r{round_}",
                                  routed_experts=_routed_experts_shape(cfg))


def _score(ctx: LoopContext, prompts: list[Prompt],
           groups: list[list[RolloutResult]]) -> tuple[list[float], int]:
    """Rewards of every sample, prompt-major; returns (rewards, number of failures counted as 0)."""
    from pipeline.scoring.rewards import RewardSample, compute_rewards

    # a sample is scored on its last model turn (a trajectory: the answer after the tools),
    # unless its environment gave the reward itself
    flat = [r for group in groups for r in group]
    samples = [RewardSample(prompt=prompt, sample_index=s_i, response_ids=r.final_turn_ids(),
                            response_text=ctx.decode(r.final_turn_ids()))
               for prompt, group in zip(prompts, groups) for s_i, r in enumerate(group)]
    result = compute_rewards(ctx.reward_fn, samples, on_error=ctx.cfg.reward.on_error)
    rewards = [r if x.env_reward is None else x.env_reward for r, x in zip(result.rewards, flat)]
    return rewards, result.num_failures


def _fill_with_informative_groups(ctx: LoopContext, step: int, prompts: list[Prompt],
                                  groups: list[list[RolloutResult]], rewards: list[float],
                                  zero_std: torch.Tensor, num_prompts: int,
                                  max_rounds: int = MAX_DYNAMIC_SAMPLING_ROUNDS):
    """Dynamic sampling: keep groups with reward variance, sample more prompts until P remain.

    Returns (prompts, groups, rewards, rounds) of the batch: at most ``max_rounds`` extra rounds,
    then zero-std groups of the first round fill what is still missing."""
    G = ctx.cfg.gspo.group_size
    chosen_prompts: list[Prompt] = []
    chosen_groups: list[list[RolloutResult]] = []
    chosen_rewards: list[float] = []

    def choose(prompt: Prompt, group: list[RolloutResult], group_rewards: list[float]) -> None:
        chosen_prompts.append(prompt)
        chosen_groups.append(group)
        chosen_rewards.extend(group_rewards)

    for i in range(len(prompts)):
        if not bool(zero_std[i]):
            choose(prompts[i], groups[i], rewards[i * G:(i + 1) * G])
    rounds = 0
    while len(chosen_prompts) < num_prompts and rounds < max_rounds:
        rounds += 1
        more = ctx.sampler.next_batch(num_prompts)
        more_groups = _generate_groups(ctx, more, step, rounds)
        more_rewards, _ = _score(ctx, more, more_groups)
        more_zero_std = is_zero_std_group(torch.tensor(more_rewards, dtype=torch.float64), G)
        for i in range(len(more)):
            if not bool(more_zero_std[i]) and len(chosen_prompts) < num_prompts:
                choose(more[i], more_groups[i], more_rewards[i * G:(i + 1) * G])
    for i in range(len(prompts)):  # not enough informative groups: top up with zero-std ones
        if bool(zero_std[i]) and len(chosen_prompts) < num_prompts:
            choose(prompts[i], groups[i], rewards[i * G:(i + 1) * G])
    return chosen_prompts, chosen_groups, chosen_rewards, rounds


def evaluate(ctx: LoopContext, step: int) -> dict:
    """Rank 0: mean reward and pass@1 (fraction of correct samples) over n samples per prompt."""
    from pipeline.generation.client import eval_seed, sampling_params

    cfg = ctx.cfg
    sampling = sampling_params(cfg.rollout, ctx.stop_token_ids)
    groups = ctx.generator.generate(ctx.eval_prompts, cfg.rollout.eval_samples_per_prompt,
                                    sampling, seed=eval_seed(cfg.run.seed),
                                    rid_prefix=f"eval{step}")
    rewards, _ = _score(ctx, ctx.eval_prompts, groups)
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


def _release_servers(ctx: LoopContext) -> None:
    from pipeline.generation.client import control

    for url in ctx.server_urls:
        control(url, "/release_memory_occupation", {"tags": None}, timeout_s=120.0)


def _resume_servers(ctx: LoopContext, tags: list[str]) -> None:
    from pipeline.generation.client import control

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
    meanwhile is made again to the servers left."""
    from pipeline.weights.push import WeightPushError

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
        if pool is not None:
            _pool_call(ctx, lambda: ctx.servers.admit())
        return stats.metrics()
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
        from pipeline.weights.parity import ParityError

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
