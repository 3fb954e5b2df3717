"""The GSPO loop: batch -> (release) -> train -> (resume) -> sync -> eval -> log -> save.

Every training rank runs :func:`run`. Global rank 0 gets each step's batch from the run's batch
source (``pipeline.sources``: ``rollout.async`` picks it once, where the session is built) and
broadcasts it; then every rank trains on its share (``trainer.train_rollout``), and every rank
takes part in the weight sync. The trainer is passed in (the Megatron side lives in
``megatron_gspo.train.rl_trainer``; this module imports no Megatron).

One step::

    batch     = source.next(step) on rank 0 (pipeline.sources.batch: P prompts from the sampler,
                G samples per prompt, rewards, [dynamic sampling], group-relative advantages;
                off: made now; one_step: made during the previous step; full: from the stream)
    (release) = colocated servers give their memory back to training
    train     = k GSPO mini-batch updates on Megatron
    (resume)  = colocated servers take their weight memory back
    sync      = source.before_weights_change() (one_step: the next rollout ends first), then
                weights -> every rollout server, weight_version = step (then the KV cache back),
                then source.weights_changed(step) (full: admit more groups)
    parity    = with parity.enabled: servers' and trainer's log-probs of fixed probes compared
                (past the threshold: sync once more, check again, else stop;
                pipeline/weights/parity.py)
    eval      = every run.eval_interval steps: mean reward and pass@1 over n samples per prompt
    log       = metrics.jsonl / TensorBoard / one progress line
    save      = every run.save_interval steps, at the last step, and on SIGTERM / SIGINT / SIGUSR1
                (then stop); then W&B / MLflow get the steps it covers (MetricsLogger.commit)

What a failure or a stop signal does is decided in one place,
``pipeline.step.step_guard.StepGuard``.
"""

from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from megatron_gspo.config import Config
from megatron_gspo.train.batching import validate_routed_experts
from pipeline.context import LoopContext, Trainer
from pipeline.sources.base import BatchSource
from pipeline.sources.choice import make_source
from pipeline.step.phases import (check_parity, evaluate, release_servers, resume_servers,
                                  server_metrics, sync_weights)
from pipeline.step.rank0 import everywhere, on_main, run_on_rank0
from pipeline.step.step_guard import Preempted, StepGuard


def run(ctx: LoopContext, trainer: Trainer, *, start_step: int,
        source: Optional[BatchSource] = None) -> dict:
    """Run steps start_step+1 .. run.num_steps; returns {"status", "history"}.

    ``source``: the batch source the session chose and restored (``pipeline.sources.choice.
    make_source``); None: a fresh one of ``rollout.async`` (nothing to restore). Status
    "finished", or "preempted" after a stop signal (a consistent checkpoint is saved:
    ``StepGuard``). A failure without a signal is an error on every rank."""
    cfg = ctx.cfg
    is_main = dist.get_rank() == 0
    source = source if source is not None else make_source(ctx, start_step)
    routes = HeldBackRoutes(cfg, dist.get_world_size())
    history: dict[str, list] = {"eval/reward_mean": []}

    def save(step: int, state: Optional[dict]) -> None:
        # rank 0 writes run_state.json (its tensors: run_state.safetensors); the others' is unused
        trainer.save(ctx.run_dir, step, state if is_main else {})
        ctx.logger.commit(step)  # no resumed run redoes steps <= step: the trackers get them

    def data_position() -> Optional[dict]:
        # collective: rank 0's source state, taken with the resync channel open (a full-mode
        # stream stops its requests for it; one waiting for a restarted server needs a sync)
        held: dict = {}
        run_on_rank0(ctx, lambda: held.update(position=source.state()))
        return held.get("position")

    guard = StepGuard(ctx.stop, save=save, start_step=start_step, data_position=data_position)
    # a server that dies mid-rollout comes back with the weights the trainer holds then
    ctx.resync = lambda version: sync_weights(ctx, trainer, version)
    ctx.weights_version = start_step
    ctx.logger.resume_at(start_step)  # each step once: drops what a crashed run logged later
    try:
        with guard.before_update():  # the servers serve exactly the policy we start from
            _first_sync(ctx, trainer, start_step, history)
        if is_main:
            source.start()
        for step in range(start_step + 1, cfg.run.num_steps + 1):
            t0, busy0 = time.monotonic(), source.busy_s()
            guard.begin(step)
            with guard.before_update():
                batch, rollout_metrics = on_main(ctx, routes.next_batch, source, step)
                routes.scatter(ctx, trainer, batch, step)
                t_batch = time.monotonic()
                if cfg.rollout.colocated:  # the servers give the memory back to training
                    on_main(ctx, release_servers, ctx, what="release server memory")

            t_train = time.monotonic()
            train_metrics = trainer.train_rollout(batch, step)
            ctx.weights_version = step
            train_s = time.monotonic() - t_train

            metrics = {f"train/{k}": v for k, v in {**rollout_metrics, **train_metrics}.items()}
            waited: dict = {}
            evaluation: dict = {}
            with guard.after_update():
                if cfg.rollout.colocated:  # weights, then the sync fills them, then the KV cache
                    on_main(ctx, resume_servers, ctx, ["weights"], what="resume server memory")
                waited = on_main(ctx, source.before_weights_change, what="rollout of the next step")
                sync = everywhere(sync_weights, ctx, trainer, step, what="weight sync")
                metrics.update({f"sync/{k}": v for k, v in (sync or {}).items()})
                if is_main:
                    source.weights_changed(step)
                    metrics.update(server_metrics(ctx))
                if cfg.rollout.colocated:
                    on_main(ctx, resume_servers, ctx, ["kv_cache", "cuda_graph"],
                            what="resume server memory")
                # after the KV cache is back: the probes are a prefill on every server
                metrics.update(everywhere(check_parity, ctx, trainer, step,
                                          what="parity check"))
                if cfg.run.eval_interval and (step % cfg.run.eval_interval == 0
                                              or step == cfg.run.num_steps):
                    evaluation = on_main(ctx, evaluate, ctx, step, what="evaluation")
                    metrics.update(evaluation)
                    history["eval/reward_mean"].append((step, evaluation["eval/reward_mean"]))

            step_s = time.monotonic() - t0
            metrics.update(_timings(step_s, train_s, source.busy_s() - busy0, waited, t_batch - t0))
            progress = progress_line(cfg, step, rollout_metrics, train_metrics, evaluation, step_s)
            if is_main:
                shown = step % cfg.run.log_interval == 0 or step == cfg.run.num_steps
                ctx.logger.log(step, metrics, progress=progress if shown else None)

            guard.end(save_due=bool(cfg.run.save_interval) and step % cfg.run.save_interval == 0,
                      last=step == cfg.run.num_steps)
    except Preempted as why:
        return _preempted(why, guard.saved_step, start_step, history, is_main)
    finally:
        source.close()
    return {"status": "finished", "history": history}


def _timings(step_s: float, train_s: float, busy_s: float, waited: dict,
             batch_wait_s: float) -> dict:
    """The step's time metrics: measured, not derived. The trainer idles whenever it is not in
    ``train_rollout``; the servers are busy for ``busy_s``, what the source measured in this
    step's window; ``waited``: the source's own (one_step: how long the trainer waited)."""
    return {"train/step_s": step_s, "train/train_s": train_s,
            "train/trainer_idle_frac": max(0.0, 1.0 - train_s / step_s),
            "train/rollout_idle_frac": max(0.0, 1.0 - busy_s / step_s),
            **{f"train/{k}": v for k, v in waited.items()},
            "train/batch_wait_s": batch_wait_s}


def _preempted(why: BaseException, saved_step: int, start_step: int, history: dict,
               is_main: bool) -> dict:
    """The run's result after a stop signal. A stop before any step of this run finished saves
    nothing (the start needs no checkpoint: a fresh run has none to write, a resumed one still
    has its own)."""
    saved = saved_step > start_step
    if is_main:
        print(f"stopping on signal ({why}); " + (
            f"checkpoint saved (step {saved_step})" if saved else
            f"no checkpoint saved (no step finished after step {start_step})"), flush=True)
    return {"status": "preempted", "history": history, "saved": saved, "start_step": start_step}


def _first_sync(ctx: LoopContext, trainer: Trainer, start_step: int, history: dict) -> None:
    """Before the first step: the servers get the weights the run starts from, the parity check
    runs, and a fresh run evaluates step 0 (logged with the parity metrics)."""
    cfg, is_main = ctx.cfg, dist.get_rank() == 0
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


class HeldBackRoutes:
    """Routing replay "rollout" on more than one rank: the routed experts (2 GB per step at 30B)
    stay out of the batch's broadcast; each rank then receives only its own rows
    (``RLTrainer.scatter_routed_experts``). Inactive otherwise: the batch goes whole."""

    def __init__(self, cfg: Config, world_size: int):
        self.active = cfg.gspo.routing_replay == "rollout" and world_size > 1
        self._model = cfg.model
        self._held = None

    def next_batch(self, source: BatchSource, step: int) -> tuple[dict, dict]:
        """Rank 0: ``source.next(step)``, its routed experts checked and held back."""
        batch, metrics = source.next(step)
        if self.active:
            validate_routed_experts(batch, self._model.num_layers, self._model.moe_router_topk,
                                    self._model.num_experts)
            batch = dict(batch)  # a source may keep the batch (a checkpoint): keep its routes there
            self._held = batch.pop("routed_experts")
        return batch, metrics

    def scatter(self, ctx: LoopContext, trainer: Trainer, batch: dict, step: int) -> None:
        """Every rank: receives the routed experts of its own rows into ``batch``."""
        if not self.active:
            return
        if dist.get_rank() == 0:
            batch["routed_experts"], self._held = self._held, None
        everywhere(trainer.scatter_routed_experts, batch, step, ctx.control_group,
                   what="routing replay rows")


def progress_line(cfg: Config, step: int, rollout_metrics: dict, train_metrics: dict,
                  evaluation: dict, step_s: float) -> str:
    """The step's console line: reward, the variant's own clip fraction (sequences for GSPO,
    tokens for token-clip variants), length, the held-out reward when evaluated, time."""
    clip = ("clip" if "clip_frac" in train_metrics else
            "token clip" if "token_clip_frac" in train_metrics else None)
    clip_value = train_metrics.get("clip_frac", train_metrics.get("token_clip_frac"))
    line = (f"step {step}/{cfg.run.num_steps}  reward {rollout_metrics['reward_mean']:.3f}"
            + (f"  {clip} {clip_value:.3f}" if clip else "")
            + f"  len {rollout_metrics['response_length_mean']:.1f}")
    if evaluation:
        line += f"  {_eval_progress(evaluation, pass_at_1=False)}"
    return line + f"  {step_s:.1f}s/step"


def _eval_progress(evaluation: dict, *, pass_at_1: bool = True) -> str:
    text = f"held-out reward {evaluation['eval/reward_mean']:.3f}"
    return (text + f"  pass@1 {evaluation['eval/pass_at_1']:.3f}") if pass_at_1 else text
