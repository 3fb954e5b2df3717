"""The batch source of ``rollout.async: off``: each step's rollout runs at the start of the step,
with the weights of the last sync (staleness 0).

Resumed from a ``one_step`` checkpoint, the first step trains the saved batch (its prompts are
drawn already: the sampler is past them); see the resume matrix in ``pipeline.sources.base``.
"""

from __future__ import annotations

from typing import Optional

from pipeline.context import LoopContext
from pipeline.sources.base import BUFFER_KEY, check_resume
from pipeline.sources.batch import rollout_phase
from pipeline.sources.saved import restored_batch


class SyncSource:
    """:class:`pipeline.sources.base.BatchSource` of ``rollout.async: off``."""

    mode = "off"

    def __init__(self, ctx: LoopContext, start_step: int):
        self._ctx = ctx
        self._buffer: Optional[dict] = None  # a one_step checkpoint's batch, not yet trained
        self._busy_s = 0.0

    def restore(self, saved: dict) -> None:
        check_resume(saved, self.mode)
        buffer = saved.get(BUFFER_KEY)
        if buffer is not None:
            self._buffer = {**buffer, "batch": restored_batch(buffer["batch"])}

    def start(self) -> None:
        """Nothing runs between steps."""

    def next(self, step: int) -> tuple[dict, dict]:
        buffer, self._buffer = self._buffer, None
        if buffer is not None and int(buffer["step"]) == step:
            # saved by a one_step run resumed with async off: its prompts are drawn already
            return buffer["batch"], dict(buffer["metrics"])
        batch, metrics = rollout_phase(self._ctx, step)
        self._busy_s += metrics["rollout_s"]
        return batch, metrics

    def before_weights_change(self) -> dict:
        return {}

    def weights_changed(self, version: int) -> None:
        """The next rollout starts with the new weights anyway."""

    def state(self) -> dict:
        """The sampler's position (and a restored batch not trained yet)."""
        now = {"sampler": self._ctx.sampler.state_dict()}
        return now if self._buffer is None else {**now, BUFFER_KEY: self._buffer}

    def busy_s(self) -> float:
        return self._busy_s

    def close(self) -> None:
        """Nothing runs."""
