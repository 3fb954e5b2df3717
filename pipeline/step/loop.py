"""The GSPO loop: rollout -> (release) -> train -> (resume) -> sync -> eval -> log -> save.

Every training rank runs :func:`run`. Global rank 0 talks to the rollout servers and the reward
function, builds the rollout batch and broadcasts it; then every rank trains on its share
(``trainer.train_rollout``), and every rank takes part in the weight sync. The trainer is passed in
(the Megatron side lives in ``megatron_gspo.train.rl_trainer``; this module imports no Megatron).

One step::

    prompts   = P prompts from the sampler (deterministic, part of the checkpoint)
    rollouts  = G samples per prompt from the servers (seeds: pipeline.generation.client.rollout_seed)
    rewards   = reward(prompt, response) per sample; non-finite or failing -> error (or 0, counted)
    [dynamic sampling: drop groups whose rewards are all equal, sample more prompts]
    advantages= group-relative (docs/gspo_math.md)
    (release) = colocated servers give their memory back to training
    train     = k GSPO mini-batch updates on Megatron
    (resume)  = colocated servers take their weight memory back
    sync      = weights -> every rollout server, weight_version = step (then the KV cache back)
    parity    = with parity.enabled: servers' and trainer's log-probs of fixed probes compared
                (past the threshold: sync once more, check again, else stop; pipeline/weights/parity.py)
    eval      = every run.eval_interval steps: mean reward and pass@1 over n samples per prompt
    log       = metrics.jsonl / TensorBoard / one progress line
    save      = every run.save_interval steps, at the last step, and on SIGTERM / SIGINT / SIGUSR1
                (then stop); then W&B / MLflow get the steps it covers (MetricsLogger.commit)

What a failure or a stop signal does is decided in one place, :class:`StepGuard`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch.distributed as dist

from megatron_gspo.config import Config
from pipeline.generation.generator import GroupGenerator, SingleTurnGenerator
from pipeline.generation.version import WeightVersion
from pipeline.observe.metrics import MetricsLogger
from pipeline.step.phases import (MAX_DYNAMIC_SAMPLING_ROUNDS, check_parity, evaluate, make_stream,
                             rollout_phase, server_metrics, stream_batch, sync_weights,
                             _release_servers, _resume_servers)
from pipeline.sources.one_step import BUFFER_KEY, RolloutProducer, decode_batch, encode_batch
from pipeline.step.rank0 import PhaseFailed, everywhere, on_main
from pipeline.signals import PREEMPTED_EXIT_CODE, STOP_SIGNALS, StopFlag
from pipeline.step.step_guard import Preempted, StepGuard

if TYPE_CHECKING:
    from pipeline.scoring.data import Prompt, PromptSampler
    from pipeline.scoring.rewards import RewardFn
    from pipeline.generation.client import RolloutClient
    from pipeline.weights.parity import ParityWatchdog
    from pipeline.servers.pool import ServerPool
    from pipeline.weights.push import WeightPusher

__all__ = ["BUFFER_KEY", "MAX_DYNAMIC_SAMPLING_ROUNDS", "PREEMPTED_EXIT_CODE", "STOP_SIGNALS",
           "LoopContext", "PhaseFailed", "Preempted", "StepGuard", "StopFlag", "Trainer",
           "check_parity", "evaluate", "everywhere", "on_main", "rollout_phase", "run",
           "sync_weights"]
"""The loop's own names and those of the modules it is made of that its callers use
(``pipeline.signals``, ``pipeline.step.rank0``, ``pipeline.step.step_guard``, ``pipeline.step.phases``)."""


class Trainer(Protocol):
    def train_rollout(self, batch: dict, step: int) -> dict: ...

    def hf_buckets(self) -> Any:
        """Collective: the policy as full HF tensor buckets (every rank iterates them)."""

    def save(self, run_dir: str, step: int, run_state: dict) -> Any: ...

    def scatter_routed_experts(self, batch: dict, step: int, group=None) -> None:
        """Collective: rank 0's ``batch["routed_experts"]`` to every rank, each its rows only
        (``gspo.routing_replay: rollout`` with more than one rank)."""


@dataclass(kw_only=True)
class LoopContext:
    """What the loop needs besides the trainer; built by ``launch.rl_session.RLSession``.

    The fields marked "rank 0" are used on global rank 0 only (None / empty elsewhere)."""

    cfg: Config
    run_dir: str
    logger: MetricsLogger
    """Rank 0 writes; the other ranks hold a disabled logger."""
    stop: StopFlag
    weights: Optional[WeightPusher] = None
    """Every rank: pushes the trainer's HF buckets to every rollout server."""
    control_group: Optional[dist.ProcessGroup] = None
    """gloo, long timeout: rank 0's broadcasts (None: the default group)."""
    sampler: Optional[PromptSampler] = None
    """Rank 0: the training prompts; its state is checkpointed (the data position)."""
    eval_prompts: list[Prompt] = field(default_factory=list)
    """Rank 0: the held-out prompts."""
    reward_fn: Optional[RewardFn] = None
    """Rank 0."""
    client: Optional[RolloutClient] = None
    """Rank 0: /generate through the router (or straight to the servers)."""
    decode: Optional[Callable[[Sequence[int]], str]] = None
    """Rank 0: token ids -> text, for the reward function."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Rank 0: extra stop tokens of every request."""
    server_urls: list[str] = field(default_factory=list)
    """Rank 0: every rollout server (release / resume of colocated servers' memory)."""
    servers: Optional[ServerPool] = None
    """Rank 0: which servers are alive (``pipeline.servers.pool``): checked before every weight
    sync, dead ones dropped and (embedded) restarted. None: every server, always."""
    parity: Optional[ParityWatchdog] = None
    """Every rank, with parity.enabled: the watchdog run after every weight sync
    (:func:`check_parity`); rank 0's holds the probe prompts."""
    rollout_buffer: Optional[dict] = None
    """Rank 0, ``rollout.async: one_step`` resumed: the next step's finished batch, from the
    checkpoint (``pipeline.sources.one_step``)."""
    rollout_stream: Optional[dict] = None
    """Rank 0, ``rollout.async: full`` resumed: the stream's complete groups and pending prompts,
    from the checkpoint (``pipeline.sources.stream``)."""
    generator: Optional[GroupGenerator] = None
    """Rank 0: the run's generator of every training and evaluation sample
    (``pipeline.generation.generator``; with ``tools`` configured, multi-turn trajectories);
    left out: a ``SingleTurnGenerator`` over ``client``."""
    resync: Optional[Callable[[str], Any]] = None
    """Every rank, set by :func:`run`: ``resync(version)`` syncs the trainer's weights
    (:func:`sync_weights`) - what rank 0's rollout has every rank do mid-phase when servers it
    restarted need the current weights (``ServerPool.wait_for_live``, :func:`pipeline.step.rank0.run_on_rank0`)."""
    weights_version: WeightVersion = 0
    """Rank 0, set by :func:`run`: the version of the weights the trainer holds now."""

    def __post_init__(self) -> None:
        if self.generator is None and self.client is not None:
            self.generator = SingleTurnGenerator(self.client)


# ------------------------------------------------------------------------------------------------
# The loop


def run(ctx: LoopContext, trainer: Trainer, *, start_step: int) -> dict:
    """Run steps start_step+1 .. run.num_steps; returns {"status", "history"}.

    Status "finished", or "preempted" after a stop signal (a consistent checkpoint is saved:
    :class:`StepGuard`). A failure without a signal is an error on every rank."""
    cfg = ctx.cfg
    is_main = dist.get_rank() == 0
    colocated = cfg.rollout.colocated
    history: dict[str, list] = {"eval/reward_mean": []}

    # rollout.async one_step: rank 0 makes step n+1's batch on a thread while step n trains
    producer = None
    if cfg.rollout.async_ == "one_step" and is_main:
        producer = RolloutProducer(lambda n: rollout_phase(ctx, n), ctx.sampler.state_dict,
                                   timeout_s=60.0 * cfg.parallel.control_timeout_minutes)
        if ctx.rollout_buffer is not None:
            producer.restore(ctx.rollout_buffer)

    # rollout.async full: rank 0's stream generates all the time (started after the first sync)
    stream = make_stream(ctx, start_step) if cfg.rollout.async_ == "full" and is_main else None

    def rank0_state() -> dict:
        """What a checkpoint of the last finished step holds of rank 0's data: the sampler's
        position (and, one_step, the next step's finished batch; full, the stream's groups)."""
        if stream is not None:  # the stream draws on its thread: both read under its lock
            return stream.state(ctx.sampler.state_dict)
        now = ctx.sampler.state_dict()
        return producer.state(now) if producer is not None else {"sampler": now}

    def save(step: int, state: Optional[dict]) -> None:
        # rank 0 writes run_state.json; the others' copy is unused
        run_state = dict(state or {})
        if BUFFER_KEY in run_state:
            buffer = run_state[BUFFER_KEY]
            run_state[BUFFER_KEY] = {**buffer, "batch": encode_batch(buffer["batch"])}
        trainer.save(ctx.run_dir, step, run_state if is_main else {})
        ctx.logger.commit(step)  # no resumed run redoes steps <= step: the trackers get them

    made_now = {"rollout_s": 0.0}  # rank 0: rollout time spent inside this step's window

    def next_batch(step: int) -> tuple[dict, dict]:
        """Rank 0: this step's batch (one_step: made during the previous step, or now if none
        is pending: the first step of a run, or a resume without a finished buffer)."""
        if stream is not None:
            made_now["rollout_s"] = 0.0  # the stream's busy time is measured on its own
            return stream_batch(ctx, stream, step)
        if producer is None:
            buffer, ctx.rollout_buffer = ctx.rollout_buffer, None
            if buffer is not None and int(buffer["step"]) == step:
                # saved by a one_step run resumed with async off: its prompts are drawn already
                made_now["rollout_s"] = 0.0
                return decode_batch(buffer["batch"]), dict(buffer["metrics"])
            batch, metrics = rollout_phase(ctx, step)
            made_now["rollout_s"] = metrics["rollout_s"]
            return batch, metrics
        made_now["rollout_s"] = 0.0
        if producer.pending_step != step:
            producer.start(step)
            producer.wait()
            made_now["rollout_s"] = producer.busy_s
        return producer.take(step)

    # routing replay "rollout": the routed experts (2 GB per step at 30B) stay out of the batch's
    # broadcast; each rank then receives only its own rows (RLTrainer.scatter_routed_experts)
    routes_apart = [None] if (cfg.gspo.routing_replay == "rollout"
                              and dist.get_world_size() > 1) else []

    def batch_apart(step: int) -> tuple[dict, dict]:
        """Rank 0: :func:`next_batch`, its routed experts checked and held back (``routes_apart``)."""
        batch, metrics = next_batch(step)
        if routes_apart:
            from megatron_gspo.train.batching import validate_routed_experts

            model = cfg.model
            validate_routed_experts(batch, model.num_layers, model.moe_router_topk,
                                    model.num_experts)
            batch = dict(batch)  # the one_step buffer may share it: keep its routes there
            routes_apart[0] = batch.pop("routed_experts")
        return batch, metrics

    def start_next(step: int) -> None:
        """Rank 0, one_step: begin the next step's rollout (with the weights of the last sync)."""
        if producer is not None and step < cfg.run.num_steps:
            producer.start(step + 1)

    def finish_next() -> dict:
        """Rank 0, one_step: wait for the next step's rollout (before the weights change)."""
        if producer is None:
            return {}
        t0 = time.monotonic()
        producer.wait()
        return {"trainer_wait_s": time.monotonic() - t0, "rollout_busy_s": producer.busy_s}

    one_step = cfg.rollout.async_ == "one_step"  # the same on every rank: same collectives

    guard = StepGuard(ctx.stop, save=save, start_step=start_step,
                      data_position=lambda: rank0_state() if is_main else None)
    # a server that dies mid-rollout comes back with the weights the trainer holds then
    ctx.resync = lambda version: sync_weights(ctx, trainer, version)
    ctx.weights_version = start_step
    ctx.logger.resume_at(start_step)  # each step once: drops what a crashed run logged later
    try:
        with guard.before_update():  # the servers serve exactly the policy we start from
            everywhere(sync_weights, ctx, trainer, start_step, what="weight sync")
            parity = everywhere(check_parity, ctx, trainer, start_step, what="parity check")
            if parity and is_main:
                print(f"parity at step {start_step}: mean log-prob gap "
                      f"{parity['parity/logprob_gap_mean']:.3g}", flush=True)
            if cfg.run.eval_interval and start_step == 0:
                evaluation = on_main(ctx, evaluate, ctx, 0, what="evaluation")
                if is_main:
                    history["eval/reward_mean"].append((0, evaluation["eval/reward_mean"]))
                    ctx.logger.log(0, {**evaluation, **parity}, progress=f"step 0/"
                                   f"{cfg.run.num_steps}  {_eval_progress(evaluation)}")
            elif parity and start_step == 0 and is_main:  # a resumed run logged its start before
                ctx.logger.log(0, parity)
        if stream is not None:
            stream.start()
        for step in range(start_step + 1, cfg.run.num_steps + 1):
            t0 = time.monotonic()
            stream_busy0 = stream.busy_s() if stream is not None else 0.0
            guard.begin(step)
            with guard.before_update():
                batch, rollout_metrics = on_main(ctx, batch_apart, step)
                if routes_apart:  # every rank receives the routed experts of its own rows
                    if is_main:
                        batch["routed_experts"], routes_apart[0] = routes_apart[0], None
                    everywhere(trainer.scatter_routed_experts, batch, step, ctx.control_group,
                               what="routing replay rows")
                t_batch = time.monotonic()
                if colocated:  # the servers give the memory back to training
                    on_main(ctx, _release_servers, ctx, what="release server memory")
                if one_step:
                    on_main(ctx, start_next, step, what="rollout of the next step")

            t_train = time.monotonic()
            train_metrics = trainer.train_rollout(batch, step)
            ctx.weights_version = step
            train_s = time.monotonic() - t_train

            metrics = {f"train/{k}": v for k, v in {**rollout_metrics, **train_metrics}.items()}
            # the variant's own clip fraction: sequences (GSPO) or tokens (token-clip variants)
            clip = ("clip" if "clip_frac" in train_metrics else
                    "token clip" if "token_clip_frac" in train_metrics else None)
            clip_value = train_metrics.get("clip_frac", train_metrics.get("token_clip_frac"))
            progress = (f"step {step}/{cfg.run.num_steps}  reward "
                        f"{rollout_metrics['reward_mean']:.3f}"
                        + (f"  {clip} {clip_value:.3f}" if clip else "")
                        + f"  len {rollout_metrics['response_length_mean']:.1f}")
            overlap: dict = {}
            with guard.after_update():
                if colocated:  # weights first, then the sync fills them, then the KV cache
                    on_main(ctx, _resume_servers, ctx, ["weights"], what="resume server memory")
                if one_step:  # the next rollout uses the servers' weights: it ends before they change
                    overlap = on_main(ctx, finish_next, what="rollout of the next step")
                sync = everywhere(sync_weights, ctx, trainer, step, what="weight sync")
                if stream is not None:  # the servers hold step's weights: admit more groups
                    stream.set_version(step)
                metrics.update({f"sync/{k}": v for k, v in (sync or {}).items()})
                if is_main:
                    metrics.update(server_metrics(ctx))
                if colocated:
                    on_main(ctx, _resume_servers, ctx, ["kv_cache", "cuda_graph"],
                            what="resume server memory")
                # after the KV cache is back: the probes are a prefill on every server
                metrics.update(everywhere(check_parity, ctx, trainer, step,
                                          what="parity check"))
                if cfg.run.eval_interval and (step % cfg.run.eval_interval == 0
                                              or step == cfg.run.num_steps):
                    evaluation = on_main(ctx, evaluate, ctx, step, what="evaluation")
                    metrics.update(evaluation)
                    history["eval/reward_mean"].append((step, evaluation["eval/reward_mean"]))
                    progress += f"  {_eval_progress(evaluation, pass_at_1=False)}"

            metrics["train/step_s"] = step_s = time.monotonic() - t0
            # measured, not derived: the trainer idles whenever it is not in train_rollout; the
            # servers generate for rollout_s (off: in this step; one_step: the next step's)
            metrics["train/train_s"] = train_s
            metrics["train/trainer_idle_frac"] = max(0.0, 1.0 - train_s / step_s)
            busy = made_now["rollout_s"] + overlap.get("rollout_busy_s", 0.0)
            if stream is not None:  # measured by the stream: time with a request on a server
                busy = stream.busy_s() - stream_busy0
            metrics["train/rollout_idle_frac"] = max(0.0, 1.0 - busy / step_s)
            if overlap:
                metrics["train/trainer_wait_rollout_s"] = overlap["trainer_wait_s"]
            metrics["train/batch_wait_s"] = t_batch - t0
            progress += f"  {metrics['train/step_s']:.1f}s/step"
            if is_main:
                shown = step % cfg.run.log_interval == 0 or step == cfg.run.num_steps
                ctx.logger.log(step, metrics, progress=progress if shown else None)

            guard.end(save_due=bool(cfg.run.save_interval) and step % cfg.run.save_interval == 0,
                      last=step == cfg.run.num_steps)
    except Preempted as why:
        # a stop before any step of this run finished saves nothing (the start needs no
        # checkpoint: a fresh run has none to write, a resumed one still has its own)
        saved = guard.saved_step > start_step
        if is_main:
            print(f"stopping on signal ({why}); " + (
                f"checkpoint saved (step {guard.saved_step})" if saved else
                f"no checkpoint saved (no step finished after step {start_step})"), flush=True)
        return {"status": "preempted", "history": history, "saved": saved,
                "start_step": start_step}
    finally:
        if stream is not None:
            stream.close()
    return {"status": "finished", "history": history}


def _eval_progress(evaluation: dict, *, pass_at_1: bool = True) -> str:
    text = f"held-out reward {evaluation['eval/reward_mean']:.3f}"
    return (text + f"  pass@1 {evaluation['eval/pass_at_1']:.3f}") if pass_at_1 else text
