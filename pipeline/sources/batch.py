"""Rank 0's batch making: prompts -> samples -> rewards -> advantages -> the training batch, with
dynamic sampling and the batch's reward and staleness metrics. Every source
(``pipeline.sources.sync``, ``one_step``, ``stream``) builds its batches here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

import torch

from megatron_gspo.config import Config
from megatron_gspo.loss.advantages import group_advantages, is_zero_std_group
from megatron_gspo.train.batching import rl_batch
from pipeline.generation.client import rollout_seed, sampling_params
from pipeline.generation.version import WeightVersion
from pipeline.generation.routed_experts import batch_routed_experts
from pipeline.scoring.rewards import RewardSample, compute_rewards
from pipeline.scoring.tasks import PAD_ID

if TYPE_CHECKING:
    from pipeline.context import LoopContext
    from pipeline.generation.trajectory import RolloutResult
    from pipeline.scoring.data import Prompt

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
    rewards, failures = score_groups(ctx, prompts, groups)
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
    results = [r for group in groups for r in group]
    # the sample's own prompt: an environment's reset() may differ from the dataset's
    prompt_ids = [list(r.prompt_ids) for r in results]
    batch = rl_batch(prompt_ids, outputs, logprobs, advantages, cfg.run.seq_length, PAD_ID,
                     output_masks=[r.output_mask for r in results])
    shape = routed_experts_shape(cfg)
    if shape is not None:  # routing replay "rollout": the experts the servers routed each token to
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


def routed_experts_shape(cfg: Config) -> Optional[tuple[int, int]]:
    """(layers, top-k) of the routed experts the training rollouts ask the servers for: with
    ``gspo.routing_replay: rollout`` only (evaluation never asks)."""
    if cfg.gspo.routing_replay != "rollout":
        return None
    return cfg.model.num_layers, cfg.model.moe_router_topk


def _generate_groups(ctx: LoopContext, prompts: list[Prompt], step: int,
                     round_: int) -> list[list[RolloutResult]]:
    cfg = ctx.cfg
    sampling = sampling_params(cfg.rollout, ctx.stop_token_ids)
    return ctx.generator.generate(prompts, cfg.gspo.group_size, sampling,
                                  seed=rollout_seed(cfg.run.seed, step, round_),
                                  rid_prefix=f"s{step}r{round_}",
                                  routed_experts=routed_experts_shape(cfg))


def score_groups(ctx: LoopContext, prompts: list[Prompt],
                 groups: list[list[RolloutResult]]) -> tuple[list[float], int]:
    """Rewards of every sample, prompt-major; returns (rewards, number of failures counted as 0)."""
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
        more_rewards, _ = score_groups(ctx, more, more_groups)
        more_zero_std = is_zero_std_group(torch.tensor(more_rewards, dtype=torch.float64), G)
        for i in range(len(more)):
            if not bool(more_zero_std[i]) and len(chosen_prompts) < num_prompts:
                choose(more[i], more_groups[i], more_rewards[i * G:(i + 1) * G])
    for i in range(len(prompts)):  # not enough informative groups: top up with zero-std ones
        if bool(zero_std[i]) and len(chosen_prompts) < num_prompts:
            choose(prompts[i], groups[i], rewards[i * G:(i + 1) * G])
    return chosen_prompts, chosen_groups, chosen_rewards, rounds
