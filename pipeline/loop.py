"""The GSPO loop, top to bottom: generate, score, train, sync weights, evaluate, save.

Every training rank runs :func:`run`. Global rank 0 talks to the rollout servers and the reward
function, builds the rollout batch and broadcasts it; then every rank trains on its share
(``trainer.train_rollout``), and every rank takes part in the weight sync. The trainer is passed in
(the Megatron side lives in ``megatron_gspo.train.rl_trainer``; this module imports no Megatron).

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

from megatron_gspo.loss.advantages import group_advantages, is_zero_std_group
from megatron_gspo.train.batching import rl_batch
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
    server_urls: list = field(default_factory=list)  # rank 0: every rollout server (colocated)


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


def _release_servers(ctx: LoopContext) -> None:
    from pipeline.rollout import control

    for url in ctx.server_urls:
        control(url, "/release_memory_occupation", {"tags": None}, timeout_s=120.0)


def _resume_servers(ctx: LoopContext, tags: list[str]) -> None:
    from pipeline.rollout import control

    for url in ctx.server_urls:
        control(url, "/resume_memory_occupation", {"tags": tags}, timeout_s=120.0)


def _on_main(ctx: LoopContext, fn, *args):
    """Run ``fn`` on rank 0 and broadcast ("ok", result) or ("error", message) to every rank, so
    that a failure there (a rollout server gone) reaches all ranks instead of hanging them."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", fn(*args))
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below (or preempted)
            outcome = ("error", f"{type(err).__name__}: {err}")
    return _broadcast(outcome)


class Preempted(Exception):
    """Stop requested (SIGTERM / SIGUSR1) and a consistent checkpoint was written."""


def run(ctx: LoopContext, trainer: Trainer, *, start_step: int) -> dict:
    """Run steps start_step+1 .. run.num_steps; returns {"status", "history"}.

    Preemption. Slurm's requeue and preemption send SIGTERM to every task at once, so the
    rollout servers may already be gone when the trainer notices. The loop therefore saves the
    last CONSISTENT state without needing the servers and returns status "preempted":
    * a signal (or a failed rollout while signalled) before step k's optimizer update: the
      checkpoint of step k-1, with the data position from before step k drew its prompts;
    * a failed weight sync or evaluation after step k's update while signalled: step k is logged
      and checkpointed without the sync (a resumed run syncs the servers first anyway).
    A failure without a signal is an error on every rank.
    """
    cfg = ctx.cfg
    is_main = dist.get_rank() == 0
    history: dict[str, list] = {"eval/reward_mean": []}
    sampler_state = lambda: ctx.sampler.state_dict() if is_main else None  # noqa: E731

    def checkpoint(step: int, sampler: Optional[dict]) -> None:
        trainer.save(ctx.run_dir, step, _broadcast({"sampler": sampler} if is_main else None))

    def checked(outcome, step_done: int, sampler: Optional[dict]):
        if outcome[0] == "ok":
            return outcome[1]
        if ctx.stop.any_rank():
            checkpoint(step_done, sampler)
            raise Preempted(outcome[1])
        raise RuntimeError(f"step {step_done + 1}: {outcome[1]}")

    try:
        try:
            trainer.sync_weights(version=str(start_step))  # the servers serve exactly this policy
        except Exception:  # noqa: BLE001 - raised on every rank
            if ctx.stop.any_rank():
                raise Preempted("signal before the first step") from None
            raise
        if cfg.run.eval_interval and start_step == 0:
            ev = checked(_on_main(ctx, evaluate, ctx, 0), start_step, sampler_state())
            if is_main:
                history["eval/reward_mean"].append((0, ev["eval/reward_mean"]))
                ctx.logger.log(0, ev, progress=f"step 0/{cfg.run.num_steps}  held-out reward "
                                               f"{ev['eval/reward_mean']:.3f}  pass@1 "
                                               f"{ev['eval/pass_at_1']:.3f}")
        for step in range(start_step + 1, cfg.run.num_steps + 1):
            t0 = time.monotonic()
            before = sampler_state()  # the data position a checkpoint of step - 1 must hold
            if ctx.stop.any_rank():
                if step > start_step + 1:
                    checkpoint(step - 1, before)
                raise Preempted("signal between steps")
            batch, rollout_metrics = checked(_on_main(ctx, rollout_phase, ctx, step), step - 1,
                                             before)
            if cfg.rollout.colocated:  # the servers give the GPUs back to training
                checked(_on_main(ctx, _release_servers, ctx), step - 1, before)
            train_metrics = trainer.train_rollout(batch, step)
            if cfg.rollout.colocated:  # weights first, then the sync fills them, then the cache
                checked(_on_main(ctx, _resume_servers, ctx, ["weights"]), step - 1, before)
            metrics = {f"train/{k}": v for k, v in {**rollout_metrics, **train_metrics}.items()}
            progress = (f"step {step}/{cfg.run.num_steps}  reward "
                        f"{rollout_metrics['reward_mean']:.3f}"
                        f"  clip {train_metrics.get('clip_frac', 0.0):.3f}"
                        f"  len {rollout_metrics['response_length_mean']:.1f}")
            interrupted = None
            try:
                sync = trainer.sync_weights(version=str(step))
                metrics.update({f"sync/{k}": v for k, v in (sync or {}).items()})
            except Exception as err:  # noqa: BLE001 - the sync raises the same error on all ranks
                if not ctx.stop.any_rank():
                    raise
                interrupted = f"weight sync: {err}"
            if interrupted is None and cfg.rollout.colocated:
                outcome = _on_main(ctx, _resume_servers, ctx, ["kv_cache", "cuda_graph"])
                if outcome[0] != "ok":
                    if not ctx.stop.any_rank():
                        raise RuntimeError(f"step {step}: resume server memory: {outcome[1]}")
                    interrupted = f"resume server memory: {outcome[1]}"
            if interrupted is None and cfg.run.eval_interval and (
                    step % cfg.run.eval_interval == 0 or step == cfg.run.num_steps):
                outcome = _on_main(ctx, evaluate, ctx, step)
                if outcome[0] == "ok":
                    if is_main:
                        metrics.update(outcome[1])
                        history["eval/reward_mean"].append((step, outcome[1]["eval/reward_mean"]))
                        progress += f"  held-out reward {outcome[1]['eval/reward_mean']:.3f}"
                elif ctx.stop.any_rank():
                    interrupted = f"evaluation: {outcome[1]}"
                else:
                    raise RuntimeError(f"step {step}: evaluation: {outcome[1]}")
            metrics["train/step_s"] = time.monotonic() - t0
            progress += f"  {metrics['train/step_s']:.1f}s/step"
            if is_main:
                ctx.logger.log(step, metrics, progress=progress if step % cfg.run.log_interval == 0
                               or step == cfg.run.num_steps else None)
            stop_now = interrupted is not None or ctx.stop.any_rank()
            due = cfg.run.save_interval and step % cfg.run.save_interval == 0
            if due or stop_now or step == cfg.run.num_steps:
                checkpoint(step, sampler_state())
            if stop_now and step < cfg.run.num_steps:
                raise Preempted(interrupted or "signal")
    except Preempted as why:
        if is_main:
            print(f"stopping on signal ({why}); checkpoint saved", flush=True)
        return {"status": "preempted", "history": history}
    return {"status": "finished", "history": history}
