"""The rollout producer of ``rollout.async: one_step``: step n+1's rollout runs while step n trains.

Rank 0 only; in a run, in rank 0's rollout producer process (``pipeline.sources.remote``
forwards the step's calls there), not in the training process. The step
(``pipeline.step.loop.run``) drives :class:`OneStepSource` once per step::

    source.next(n)                   # producer.take(n): the batch made during step n-1 (or now,
                                     # at the start); producer.start(n + 1): a thread, prompts ->
                                     # samples -> rewards -> batch n+1
    trainer.train_rollout(batch_n)   # meanwhile, on every rank
    source.before_weights_change()   # producer.wait(): batch n+1 is complete (weights of n-1)
    sync_weights(version n)          # then the servers take the new weights

So every sample of batch n+1 comes from the policy of step n-1: the trained policy is exactly one
version ahead of the behaviour policy (staleness 1, the same for every token; ``off`` gives 0).
The weights are pushed once per step, after the rollout that used the old ones has finished, so a
push never meets requests in flight (verl's one-step off-policy schedule). The decoupled GSPO
objective (``gspo.old_logprobs: recompute`` with the behaviour weight, docs/gspo_math.md) takes
the ratio against the trainer's own policy and weights each sequence by its truncated behaviour
ratio.

**Nothing is lost at a checkpoint.** When the loop saves step n, batch n+1 is complete: its
tensors and metrics are part of rank 0's run state (:meth:`state`, a safetensors blob in
``run_state.json``) and the sampler's position is the one after its prompts, so a resumed run
trains exactly the batch the uninterrupted run would have trained. A rollout that failed or was
interrupted is not saved: the state then holds the sampler position from before its prompts and
the resumed run makes it again (with the newer weights; said in docs/async.md). The batch is
trained on resume under ``one_step`` or ``off``; ``full`` refuses the checkpoint before the ranks
start (the resume matrix, ``pipeline.sources.base``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from pipeline.context import LoopContext
from pipeline.sources.base import BUFFER_KEY, check_resume
from pipeline.sources.batch import rollout_phase
from pipeline.sources.saved import restored_batch


class RolloutProducer:
    """Runs ``make(step) -> (batch, metrics)`` (``pipeline.sources.batch.rollout_phase``) on a
    thread.

    ``sampler_state``: the data position now (the sampler's ``state_dict``), read before each
    rollout draws its prompts (what a checkpoint holds when the rollout is not complete)."""

    def __init__(self, make: Callable[[int], tuple[dict, dict]],
                 sampler_state: Callable[[], Optional[dict]], *, timeout_s: float = 3600.0):
        self._make, self._sampler_state = make, sampler_state
        self.timeout_s = timeout_s
        """The longest :meth:`wait` blocks for one rollout (the loop: parallel.
        control_timeout_minutes, what the other ranks wait for rank 0 anyway)."""
        self._thread: Optional[threading.Thread] = None
        self._step: Optional[int] = None
        self._result: Optional[tuple[dict, dict]] = None
        self._error: Optional[BaseException] = None
        self._sampler_before: Optional[dict] = None
        self._failed = False
        self.busy_s = 0.0
        """Seconds the last rollout ran (its own wall time, on the thread)."""
        self.finished_at: Optional[float] = None
        """``time.monotonic()`` when the last rollout ended."""

    # --- the schedule
    def start(self, step: int) -> None:
        """Begin ``step``'s rollout on a thread (the previous one must have been taken)."""
        if self._thread is not None or self._result is not None:
            raise RuntimeError(f"rollout of step {step} started while step {self._step}'s is "
                               "not taken")
        self._step, self._error, self._failed = step, None, False
        self._sampler_before = self._sampler_state()
        self._thread = threading.Thread(target=self._run, args=(step,), daemon=True,
                                        name=f"rollout step {step}")
        self._thread.start()

    def _run(self, step: int) -> None:
        t0 = time.monotonic()
        try:
            self._result = self._make(step)
        except BaseException as err:  # noqa: BLE001 - re-raised by wait() on the loop's thread
            self._error = err
        finally:
            self.finished_at = time.monotonic()
            self.busy_s = self.finished_at - t0

    def wait(self) -> None:
        """Block until the running rollout ends (at most ``timeout_s``: then TimeoutError naming
        the step); re-raise its error. No-op when none runs."""
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():  # left running (a daemon thread): the run stops
                self._failed = True
                raise TimeoutError(f"the rollout of step {self._step} did not finish within "
                                   f"{self.timeout_s:g} s (parallel.control_timeout_minutes)")
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            self._result, self._failed = None, True  # a checkpoint now holds _sampler_before
            raise error

    def take(self, step: int) -> tuple[dict, dict]:
        """``step``'s (batch, metrics): waits for its rollout; the producer is then idle."""
        self.wait()
        if self._result is None or self._step != step:
            raise RuntimeError(f"no rollout of step {step} (have: step {self._step})")
        result, self._result = self._result, None
        self._sampler_before = None
        return result

    @property
    def pending_step(self) -> Optional[int]:
        """The step whose rollout runs or waits to be taken (None: idle)."""
        return self._step if (self._thread is not None or self._result is not None) else None

    # --- checkpoints
    def state(self, sampler_now: Optional[dict]) -> dict:
        """Rank 0's run state: the sampler position and, when the next step's batch is complete,
        that batch (tensors: the checkpoint writes them to ``run_state.safetensors``) and its
        metrics."""
        if self._thread is None and self._result is not None:
            batch, metrics = self._result
            return {"sampler": sampler_now,
                    BUFFER_KEY: {"step": self._step, "batch": batch, "metrics": metrics}}
        if self._thread is not None or self._failed:  # running, or ended without a batch
            return {"sampler": self._sampler_before}  # made again on resume
        return {"sampler": sampler_now}

    def restore(self, buffer: dict) -> None:
        """Take a saved buffer back (a resumed run): ``take(buffer["step"])`` returns it."""
        self._step = int(buffer["step"])
        self._result = (restored_batch(buffer["batch"]), dict(buffer["metrics"]))


class OneStepSource:
    """:class:`pipeline.sources.base.BatchSource` of ``rollout.async: one_step``: the producer,
    making step n+1's batch while step n trains."""

    mode = "one_step"

    def __init__(self, ctx: LoopContext, start_step: int):
        self._ctx = ctx
        self._producer = RolloutProducer(
            lambda n: rollout_phase(ctx, n), lambda: ctx.sampler.state_dict(),
            timeout_s=60.0 * ctx.cfg.parallel.control_timeout_minutes)
        self._busy_s = 0.0

    def restore(self, saved: dict) -> None:
        check_resume(saved, self.mode)
        if saved.get(BUFFER_KEY) is not None:
            self._producer.restore(saved[BUFFER_KEY])

    def start(self) -> None:
        """The first rollout starts with the first step (:meth:`next`)."""

    def next(self, step: int) -> tuple[dict, dict]:
        """Step ``step``'s batch (made during the previous step, or now if none is pending: the
        first step of a run, or a resume without a finished buffer); then the next step's
        rollout begins, with the weights of the last sync."""
        producer = self._producer
        if producer.pending_step != step:
            producer.start(step)
            producer.wait()
            self._busy_s += producer.busy_s
        result = producer.take(step)
        if step < self._ctx.cfg.run.num_steps:
            producer.start(step + 1)
        return result

    def before_weights_change(self) -> dict:
        """The next rollout uses the servers' weights: it ends before they change."""
        t0 = time.monotonic()
        running = self._producer.pending_step is not None
        self._producer.wait()
        if running:
            self._busy_s += self._producer.busy_s
        return {"trainer_wait_rollout_s": time.monotonic() - t0}

    def weights_changed(self, version: int) -> None:
        """The next rollout starts at the next step, with these weights."""

    def state(self) -> dict:
        return self._producer.state(self._ctx.sampler.state_dict())

    def busy_s(self) -> float:
        """The rollouts' own wall time, each counted when it is waited for."""
        return self._busy_s

    def close(self) -> None:
        """A rollout still running is a daemon thread; its batch is not needed."""
