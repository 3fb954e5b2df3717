"""The one place ``rollout.async`` picks the batch source (``launch.rl_session.RLSession``
calls :func:`make_source` once; ``pipeline.step.loop.run`` for callers that pass none)."""

from __future__ import annotations

from pipeline.context import LoopContext
from pipeline.sources.base import BatchSource
from pipeline.sources.one_step import OneStepSource
from pipeline.sources.stream import StreamSource
from pipeline.sources.sync import SyncSource

SOURCES = {"off": SyncSource, "one_step": OneStepSource, "full": StreamSource}
"""``rollout.async`` -> its :class:`pipeline.sources.base.BatchSource`."""


def make_source(ctx: LoopContext, start_step: int) -> BatchSource:
    """The batch source of ``ctx.cfg.rollout.async_`` for a run that starts after
    ``start_step`` (not restored, not started; every rank may hold one)."""
    return SOURCES[ctx.cfg.rollout.async_](ctx, start_step)
