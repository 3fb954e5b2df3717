"""The supervised cold-start loop: sample pairs, train, evaluate, log.

Pairs come from ``data``: the synthetic task (prompt, exact answer), or a JSONL / Parquet file
whose ``data.prompt_key`` holds the prompt and ``data.label_key`` the response. Every rank draws
the same global batch from the seeded sampler; the trainer (``megatron_gspo.train.sft.SFTTrainer``
or anything with the :class:`SFTStepper` methods) trains each data-parallel rank on its share.

With ``run.save_interval`` > 0 every rank calls ``trainer.save`` (collective) after every
save_interval-th step and after the last, with the sampler's position as the run state; a resumed
run (``start_step`` and that ``run_state``, from ``trainer.load``) draws exactly the batches the
uninterrupted run would have drawn. Every step logs ``train/lr``, the learning rate it used. After
each checkpoint, and at the end, ``logger.commit`` hands the steps it covers to W&B / MLflow.

Stop signals (``stop``, a ``pipeline.signals.StopFlag``: SIGTERM, SIGINT, SIGUSR1 to any rank): after
each step every rank learns whether any rank was signalled (one tiny all-reduce); if so, every
rank saves that step's checkpoint (whatever ``run.save_interval`` says, unless the step was just
saved) and the loop returns with ``preempted`` set; ``sft --resume`` continues right after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from megatron_gspo.config import Config
from megatron_gspo.errors import ExplainedError
from pipeline.scoring.data import PromptSampler, build_datasets
from pipeline.signals import StopFlag
from pipeline.observe.metrics import MetricsLogger

Pairs = list[tuple[list[int], list[int]]]


class SFTStepper(Protocol):
    def train_batch(self, pairs: Pairs) -> dict[str, float]: ...

    def eval_loss(self, pairs: Pairs) -> float: ...

    def save(self, run_dir: str, step: int, run_state: dict) -> Any: ...


def sft_pairs(prompts: list, encoder) -> Pairs:
    """(prompt ids, response ids + end token) for Prompts whose label is the response."""
    pairs = []
    for prompt in prompts:
        if prompt.label is None:
            raise ValueError(f"{prompt.origin}: no response (data.label_key) to fine-tune on")
        pairs.append((prompt.prompt_ids, encoder.encode_text(prompt.label) + [encoder.eos_id]))
    return pairs


@dataclass
class SFTResult:
    losses: list[float] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    preempted: bool = False
    """Stopped by a signal after saving the checkpoint of the last step trained."""


def run_sft(trainer: SFTStepper, cfg: Config, *, logger: MetricsLogger, start_step: int = 0,
            run_state: Optional[dict] = None, stop: Optional[StopFlag] = None) -> SFTResult:
    """Train SFT steps ``start_step + 1 .. run.num_steps``; returns the loss curves of those steps.

    ``run_state``: what ``trainer.load`` returned for the checkpoint of ``start_step`` (its
    ``sampler`` position); None for a fresh run. ``stop``: the installed stop flag (None: no
    signal handling here); collective when given (every rank calls ``stop.any_rank``)."""
    train_set, eval_set = build_datasets(cfg.data, seed=cfg.run.seed)
    sampler = PromptSampler(train_set, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    if start_step:
        if not run_state or "sampler" not in run_state:
            raise ValueError(f"resuming SFT at step {start_step} needs the checkpoint's run state "
                             "with the sampler position")
        sampler.load_state_dict(run_state["sampler"])
    eval_pairs = sft_pairs([eval_set[i] for i in range(len(eval_set))], train_set.encoder) \
        if eval_set is not None else None
    gbs = cfg.run.global_batch_size
    result = SFTResult()
    logger.resume_at(start_step)  # each step once: drops what a crashed run logged later
    if eval_pairs and start_step == 0:
        result.eval_losses.append(trainer.eval_loss(eval_pairs))
        logger.log(0, {"eval/loss": result.eval_losses[0]},
                   progress=f"step 0/{cfg.run.num_steps}  held-out loss {result.eval_losses[0]:.4f}")
    save_interval = cfg.run.save_interval
    for step in range(start_step + 1, cfg.run.num_steps + 1):
        start = time.monotonic()
        try:
            out = trainer.train_batch(sft_pairs(sampler.next_batch(gbs), train_set.encoder))
        except ExplainedError as err:  # a non-finite loss or gradient: not applied, nothing saved
            err.add_note(f"step {step}")
            raise
        loss = out["loss"]
        result.losses.append(loss)
        elapsed = time.monotonic() - start
        metrics = {"train/loss": loss, "train/grad_norm": out["grad_norm"], "train/lr": out["lr"],
                   "train/tokens_per_s": gbs * cfg.run.seq_length / elapsed, "train/step_s": elapsed}
        progress = (f"step {step}/{cfg.run.num_steps}  loss {loss:.4f}  "
                    f"grad_norm {out['grad_norm']:.3f}  lr {out['lr']:.3g}  {elapsed:.2f}s/step")
        if eval_pairs and (cfg.run.eval_interval and step % cfg.run.eval_interval == 0
                           or step == cfg.run.num_steps):
            result.eval_losses.append(trainer.eval_loss(eval_pairs))
            metrics["eval/loss"] = result.eval_losses[-1]
            progress += f"  held-out loss {result.eval_losses[-1]:.4f}"
        if step % cfg.run.log_interval == 0 or step == cfg.run.num_steps:
            logger.log(step, metrics, progress=progress)
        else:
            logger.log(step, metrics)
        saved = bool(save_interval) and (step % save_interval == 0 or step == cfg.run.num_steps)
        if saved:
            trainer.save(cfg.run.output_dir, step, {"sampler": sampler.state_dict()})
            logger.commit(step)
        if stop is not None and step < cfg.run.num_steps and stop.any_rank():
            if not saved:
                trainer.save(cfg.run.output_dir, step, {"sampler": sampler.state_dict()})
                logger.commit(step)
            result.preempted = True
            break
    if not result.preempted:  # finished: no run redoes its steps (saved or not)
        logger.commit(cfg.run.num_steps)
    return result
