"""What a failure or a stop signal does, depending on where in the step it happens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Optional

from pipeline.signals import StopFlag
from pipeline.step.rank0 import PhaseFailed

class Preempted(Exception):
    """Stop requested (SIGTERM / SIGINT / SIGUSR1) and a consistent checkpoint was written."""


class StepGuard:
    """What a failure or a stop signal does, depending on where in the step it happens.

    Slurm's requeue and preemption send SIGTERM to every task at once, so the rollout servers may
    already be gone when the trainer notices. The rule is: on a signal, save the last CONSISTENT
    state without needing the servers, then stop (:class:`Preempted`):

    * ``begin(step)``: a signal since the last step -> the checkpoint of step - 1, stop;
    * ``with before_update():`` a :class:`PhaseFailed` before step k's optimizer update (rollout,
      releasing the servers' memory) while signalled -> the checkpoint of step k - 1, with the data
      position from before step k drew its prompts; stop;
    * ``with after_update():`` a :class:`PhaseFailed` after the update (resuming the servers'
      memory, the weight sync, the evaluation) while signalled -> the rest of the block is
      skipped, and ``end`` saves step k (logged, without the sync: a resumed run syncs the
      servers first anyway) and stops;
    * ``end(save_due=...)``: saves when due, at the last step, or when signalled; then stops if
      signalled (at the last step the run simply finishes).

    A failure without a signal is an error on every rank: rank 0's error, re-raised everywhere
    as its own type (or a :class:`~megatron_gspo.errors.RemoteError`) with the note ``"step k:
    <phase>"`` (``megatron_gspo.errors.one_line`` puts it before the message), or the
    collective's own exception. A step is never saved twice, nor is the step the run started
    from (its checkpoint exists; for step 0 a fresh start is the same). Anything but
    :class:`PhaseFailed` passes through untouched (it need not have happened on every rank, so
    no collective may run on its behalf). Collective: every rank makes the same calls, and
    ``data_position()`` (rank 0's data position, None on the others) is one too.
    """

    def __init__(self, stop: StopFlag, *, save: Callable[[int, Optional[dict]], None],
                 data_position: Callable[[], Optional[dict]], start_step: int):
        self.stop = stop
        self._save = save
        self._data_position = data_position
        self.saved_step = start_step
        """The newest step whose state a checkpoint holds (or the run's start)."""
        self.step = start_step + 1
        """The step in progress (before ``begin`` of the first step: the initial sync)."""
        self.interrupted: Optional[str] = None
        self._position_before: Optional[dict] = None

    def begin(self, step: int) -> None:
        self.step, self.interrupted = step, None
        self._position_before = self._data_position()  # what a checkpoint of step - 1 holds
        if self.stop.any_rank():
            self._stop("signal between steps", self.step - 1, self._position_before)

    @contextmanager
    def before_update(self) -> Iterator[None]:
        try:
            yield
        except PhaseFailed as failed:
            if not self.stop.any_rank():
                raise self._error(failed) from None
            self._stop(failed.message, self.step - 1, self._position_before)

    @contextmanager
    def after_update(self) -> Iterator[None]:
        try:
            yield
        except PhaseFailed as failed:
            if not self.stop.any_rank():
                raise self._error(failed) from None
            self.interrupted = failed.message

    def end(self, *, save_due: bool, last: bool) -> None:
        stop_now = self.interrupted is not None or self.stop.any_rank()
        if save_due or last or stop_now:
            self._checkpoint(self.step, self._data_position())
        if stop_now and not last:
            raise Preempted(self.interrupted or "signal")

    def _error(self, failed: PhaseFailed) -> BaseException:
        if failed.cause is None:
            return RuntimeError(f"step {self.step}: {failed.message}")
        if failed.on_rank0:  # rank 0's error, as a type on every rank: where it happened
            failed.cause.add_note(f"step {self.step}: {failed.phase}" if failed.phase
                                  else f"step {self.step}")
        return failed.cause

    def _checkpoint(self, step: int, data_position: Optional[dict]) -> None:
        self._save(step, data_position)
        self.saved_step = step

    def _stop(self, reason: str, done_step: int, data_position: Optional[dict]) -> None:
        if done_step > self.saved_step:
            self._checkpoint(done_step, data_position)
        raise Preempted(reason)
