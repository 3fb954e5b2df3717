"""The one place ``rollout.async`` picks the batch source (``launch.rl_session.RLSession``
calls :func:`make_source` once; ``pipeline.step.loop.run`` for callers that pass none).

``off`` makes each batch in the training process (the rollout never overlaps training there);
``one_step`` and ``full`` run their producer in a process of its own when rank 0's context says
how to build the rollout client there (``LoopContext.engine``, what a run's session sets:
``pipeline.sources.remote.RemoteSource``), else on a thread of this process (the same source,
``pipeline.sources.one_step`` / ``stream``: what the producer process runs, and what tests with
in-process fakes drive directly).
"""

from __future__ import annotations

from pipeline.context import LoopContext
from pipeline.sources.base import BatchSource
from pipeline.sources.one_step import OneStepSource
from pipeline.sources.remote import RemoteSource
from pipeline.sources.stream import StreamSource
from pipeline.sources.sync import SyncSource

SOURCES = {"off": SyncSource, "one_step": OneStepSource, "full": StreamSource}
"""``rollout.async`` -> its in-process :class:`pipeline.sources.base.BatchSource`."""
IN_ITS_OWN_PROCESS = ("one_step", "full")
"""The modes whose producer runs in a process of its own (:class:`RemoteSource`) in a run."""


def make_source(ctx: LoopContext, start_step: int) -> BatchSource:
    """The batch source of ``ctx.cfg.rollout.async_`` for a run that starts after
    ``start_step`` (not restored, not started; every rank may hold one)."""
    mode = ctx.cfg.rollout.async_
    if mode in IN_ITS_OWN_PROCESS and ctx.engine is not None:
        return RemoteSource(ctx, start_step, mode=mode, engine=ctx.engine)
    return SOURCES[mode](ctx, start_step)
