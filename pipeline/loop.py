"""The GSPO loop, top to bottom: generate, score, train, sync weights, evaluate, save.

Every training rank runs :func:`run`. Global rank 0 talks to the rollout servers and the reward
function, builds the rollout batch and broadcasts it; then every rank trains on its share
(``trainer.train_rollout``), and every rank takes part in the weight sync. The trainer is passed in
(the Megatron side lives in ``megatron_gspo.rl_trainer``; this module imports no Megatron).

One step::

    prompts   = P prompts from the sampler (deterministic, part of the checkpoint)
    rollouts  = G samples per prompt from the servers (sampling seeds from (run.seed, step))
    rewards   = reward(prompt, response) per sample; non-finite or failing -> error (or 0, counted)
    [dynamic sampling: drop groups whose rewards are all equal, sample more prompts]
    advantages= group-relative (gspo_math.md)
    train     = k GSPO mini-batch updates on Megatron
    sync      = weights -> every rollout server, weight_version = step
    eval      = every run.eval_interval steps: mean reward and pass@1 over n samples per prompt
    save      = every run.save_interval steps, and on SIGTERM / SIGUSR1 (then stop)
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from megatron_gspo.advantages import group_advantages, is_zero_std_group
from pipeline.batching import rl_batch
from pipeline.metrics import MetricsLogger

PREEMPTED_EXIT_CODE = 75
"""Exit status of a run stopped by SIGTERM / SIGUSR1 after saving a checkpoint (EX_TEMPFAIL):
"requeue me". A finished run exits 0, a failed one with another non-zero status."""


class Trainer(Protocol):
    def train_rollout(self, batch: dict, step: int) -> dict: ...

    def sync_weights(self, version: str) -> dict: ...

    def save(self, run_dir: str, step: int, run_state: dict) -> Any: ...


@dataclass
class StopFlag:
    """Set by SIGTERM / SIGUSR1: finish the current step, save, exit with PREEMPTED_EXIT_CODE."""

    signum: Optional[int] = None
    _previous: dict = field(default_factory=dict)

    def install(self) -> "StopFlag":
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    def any_rank(self) -> bool:
        """True on every rank if any rank was signalled (one tiny all-reduce)."""
        flag = torch.tensor([1.0 if self.signum is not None else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


@dataclass
class LoopContext:
    """What the loop needs besides the trainer; built by launch/train.py."""

    cfg: Any  # megatron_gspo.config.Config
    run_dir: str
    sampler: Any  # pipeline.data.PromptSampler (rank 0 uses it; its state is checkpointed)
    eval_prompts: list  # list[pipeline.data.Prompt]
    reward_fn: Any
    client: Any  # pipeline.rollout.RolloutClient (rank 0)
    decode: Any  # ids -> text
    stop_token_ids: list[int]
    logger: MetricsLogger
    stop: StopFlag


def _score(ctx: LoopContext, prompts: list, groups: list[list]) -> tuple[list[float], int]:
    """Rewards of every sample, prompt-major; returns (rewards, number of failures counted as 0)."""
    from pipeline.rewards import RewardSample, compute_rewards

    samples = []
    for p_i, (prompt, group) in enumerate(zip(prompts, groups)):
        for s_i, result in enumerate(group):
            samples.append(RewardSample(prompt=prompt, sample_index=s_i,
                                        response_ids=list(result.output_ids),
                                        response_text=ctx.decode(result.output_ids)))
    result = compute_rewards(ctx.reward_fn, samples, on_error=ctx.cfg.reward.on_error)
    return list(result.rewards), result.num_failures


def _generate_groups(ctx: LoopContext, prompts: list, step: int, salt: int) -> list[list]:
    cfg = ctx.cfg
    from pipeline.rollout import SamplingParams

    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                              stop_token_ids=ctx.stop_token_ids)
    return ctx.client.generate_groups([p.prompt_ids for p in prompts], cfg.gspo.group_size,
                                      sampling, seed=(cfg.run.seed * 1_000_003 + step) * 7 + salt)


def rollout_phase(ctx: LoopContext, step: int) -> tuple[dict, dict]:
    """Rank 0: prompts -> samples -> rewards -> advantages -> the training batch and metrics."""
    cfg = ctx.cfg
    num_prompts = cfg.run.global_batch_size // cfg.gspo.group_size
    start = time.monotonic()
    prompts = ctx.sampler.next_batch(num_prompts)
    groups = _generate_groups(ctx, prompts, step, 0)
    rewards, failures = _score(ctx, prompts, groups)
    metrics: dict[str, float] = {}
    all_rewards = torch.tensor(rewards, dtype=torch.float64)
    zero_std = is_zero_std_group(all_rewards, cfg.gspo.group_size)
    metrics["zero_std_group_frac"] = float(zero_std.float().mean())
    metrics["reward_mean"] = float(all_rewards.mean())
    metrics["reward_std"] = float(all_rewards.std(unbiased=False))
    if cfg.gspo.dynamic_sampling:
        prompts, groups, rewards, rounds = _fill_with_informative_groups(
            ctx, step, prompts, groups, rewards, zero_std, num_prompts)
        metrics["dynamic_sampling_rounds"] = rounds
    gen_s = time.monotonic() - start
    outputs = [list(r.output_ids) for group in groups for r in group]
    logprobs = [list(r.output_logprobs) for group in groups for r in group]
    prompt_ids = [p.prompt_ids for p, group in zip(prompts, groups) for _ in group]
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), cfg.gspo.group_size,
                                  normalize_std=cfg.gspo.normalize_std,
                                  leave_one_out=cfg.gspo.leave_one_out)
    from pipeline.tasks import PAD_ID

    batch = rl_batch(prompt_ids, outputs, logprobs, advantages, cfg.run.seq_length, PAD_ID)
    lengths = torch.tensor([len(o) for o in outputs], dtype=torch.float64)
    finish = [r.finish_reason for group in groups for r in group]
    metrics.update({
        "response_length_mean": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncated_frac": sum(f == "length" for f in finish) / len(finish),
        "reward_failures": failures,
        "rollout_s": gen_s,
        "rollout_tokens_per_s": float(lengths.sum()) / max(gen_s, 1e-9),
    })
    return batch, metrics


def _fill_with_informative_groups(ctx, step, prompts, groups, rewards, zero_std, num_prompts,
                                  max_rounds: int = 8):
    """Dynamic sampling: keep groups with reward variance, sample more prompts until P remain."""
    G = ctx.cfg.gspo.group_size
    keep = [i for i in range(len(prompts)) if not bool(zero_std[i])]
    kept_p = [prompts[i] for i in keep]
    kept_g = [groups[i] for i in keep]
    kept_r = [r for i in keep for r in rewards[i * G:(i + 1) * G]]
    rounds = 0
    while len(kept_p) < num_prompts and rounds < max_rounds:
        rounds += 1
        more = ctx.sampler.next_batch(num_prompts)
        more_groups = _generate_groups(ctx, more, step, rounds)
        more_rewards, _ = _score(ctx, more, more_groups)
        more_zero = is_zero_std_group(torch.tensor(more_rewards, dtype=torch.float64), G)
        for i in range(len(more)):
            if not bool(more_zero[i]) and len(kept_p) < num_prompts:
                kept_p.append(more[i])
                kept_g.append(more_groups[i])
                kept_r += more_rewards[i * G:(i + 1) * G]
    if len(kept_p) < num_prompts:  # not enough informative groups: top up with zero-std ones
        for i in range(len(prompts)):
            if bool(zero_std[i]) and len(kept_p) < num_prompts:
                kept_p.append(prompts[i])
                kept_g.append(groups[i])
                kept_r += rewards[i * G:(i + 1) * G]
    return kept_p, kept_g, kept_r, rounds


def evaluate(ctx: LoopContext, step: int) -> dict:
    """Rank 0: mean reward and pass@1 (fraction of correct samples) over n samples per prompt."""
    cfg = ctx.cfg
    from pipeline.rollout import SamplingParams

    n = cfg.rollout.eval_samples_per_prompt
    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens,
                              stop_token_ids=ctx.stop_token_ids)
    groups = ctx.client.generate_groups([p.prompt_ids for p in ctx.eval_prompts], n, sampling,
                                        seed=cfg.run.seed * 31 + 17)
    rewards, _ = _score(ctx, ctx.eval_prompts, groups)
    r = torch.tensor(rewards, dtype=torch.float64)
    return {"eval/reward_mean": float(r.mean()), "eval/pass_at_1": float((r >= 1.0).double().mean())}


def _broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run(ctx: LoopContext, trainer: Trainer, *, start_step: int) -> dict:
    """Run steps start_step+1 .. run.num_steps. Returns the last metrics (rank 0) and status."""
    cfg = ctx.cfg
    is_main = dist.get_rank() == 0
    history: dict[str, list] = {"eval/reward_mean": []}
    trainer.sync_weights(version=str(start_step))  # the servers serve exactly this policy
    if cfg.run.eval_interval and start_step == 0:
        ev = evaluate(ctx, 0) if is_main else None
        if is_main:
            history["eval/reward_mean"].append((0, ev["eval/reward_mean"]))
            ctx.logger.log(0, ev, progress=f"step 0/{cfg.run.num_steps}  held-out reward "
                                           f"{ev['eval/reward_mean']:.3f}  pass@1 "
                                           f"{ev['eval/pass_at_1']:.3f}")
    status = "finished"
    for step in range(start_step + 1, cfg.run.num_steps + 1):
        t0 = time.monotonic()
        batch, rollout_metrics = rollout_phase(ctx, step) if is_main else (None, None)
        batch, rollout_metrics = _broadcast((batch, rollout_metrics))
        train_metrics = trainer.train_rollout(batch, step)
        sync = trainer.sync_weights(version=str(step))
        metrics = {f"train/{k}": v for k, v in {**rollout_metrics, **train_metrics}.items()}
        metrics.update({f"sync/{k}": v for k, v in (sync or {}).items()})
        metrics["train/step_s"] = time.monotonic() - t0
        progress = (f"step {step}/{cfg.run.num_steps}  reward {rollout_metrics['reward_mean']:.3f}"
                    f"  clip {train_metrics.get('clip_frac', 0.0):.3f}"
                    f"  len {rollout_metrics['response_length_mean']:.1f}"
                    f"  {metrics['train/step_s']:.1f}s/step")
        if cfg.run.eval_interval and (step % cfg.run.eval_interval == 0 or step == cfg.run.num_steps):
            ev = evaluate(ctx, step) if is_main else None
            if is_main:
                metrics.update(ev)
                history["eval/reward_mean"].append((step, ev["eval/reward_mean"]))
                progress += f"  held-out reward {ev['eval/reward_mean']:.3f}"
        if is_main:
            ctx.logger.log(step, metrics, progress=progress if step % cfg.run.log_interval == 0
                           or step == cfg.run.num_steps else None)
        stop_now = ctx.stop.any_rank()
        due = cfg.run.save_interval and step % cfg.run.save_interval == 0
        if due or stop_now or step == cfg.run.num_steps:
            run_state = _broadcast({"sampler": ctx.sampler.state_dict()} if is_main else None)
            trainer.save(ctx.run_dir, step, run_state)
        if stop_now and step < cfg.run.num_steps:
            status = "preempted"
            break
    return {"status": status, "history": history}
