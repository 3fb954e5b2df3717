"""What the rollout producer process is built from (:class:`ProducerSpec`, plain data sent over its
pipe) and how (:func:`build_producer`): the in-process batch source of the mode
(``pipeline.sources.one_step.OneStepSource``, ``pipeline.sources.stream.StreamSource``), over its
own client, generator, reward function and prompt sampler.

Everything the rollout thread of rank 0 did runs there unchanged; what stays on rank 0 is what
needs the training ranks or owns the servers: the server pool (dead servers, restarts, the resync
of a restarted server through every rank, the router's re-admission), reached through
:class:`PoolHooks`, and the weight pusher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from megatron_gspo.config import Config
from pipeline.context import LoopContext
from pipeline.engines.factory import ClientSpec, build_client, build_generator
from pipeline.observe.metrics import MetricsLogger
from pipeline.scoring.rewards import build_reward
from pipeline.signals import StopFlag
from pipeline.sources.base import BatchSource
from pipeline.sources.one_step import OneStepSource
from pipeline.sources.stream import StreamSource

if TYPE_CHECKING:
    from pipeline.producer.endpoint import Endpoint
    from pipeline.scoring.data import PromptSampler

IN_PROCESS = {"one_step": OneStepSource, "full": StreamSource}
"""``rollout.async`` -> the batch source the producer process runs (the modes it serves)."""


@dataclass(frozen=True)
class ProducerSpec:
    """The recipe of a producer process (pickled into it once, at its start)."""

    mode: str
    """``rollout.async``: one of :data:`IN_PROCESS`."""
    cfg: Config
    run_dir: str
    start_step: int
    client: ClientSpec
    sampler: PromptSampler
    """The training prompts at the data position of the run's start; the producer draws every
    prompt from here on (rank 0's copy is not used again)."""
    has_pool: bool
    """Rank 0 has a server pool: the client's failures ask it (:class:`PoolHooks`)."""


class PoolHooks:
    """The producer's stand-in for rank 0's ``pipeline.servers.pool.ServerPool``, as the rollout
    client uses it (``RolloutClient.servers``): each hook is a call to rank 0, which runs the
    pool's own on a thread there."""

    def __init__(self, endpoint: Endpoint):
        self._endpoint = endpoint
        self._retried = 0

    def wait_for_live(self, error: BaseException) -> bool:
        return self._endpoint.call("wait_for_live", error)

    def wait_for_router(self, answered_at: float, first_at: float) -> None:
        # time.monotonic() is the machine's CLOCK_MONOTONIC: the same in both processes
        self._endpoint.call("wait_for_router", answered_at, first_at)

    @property
    def requests_retried(self) -> int:
        return self._retried

    @requests_retried.setter
    def requests_retried(self, value: int) -> None:  # the client's ``+= 1``, counted on rank 0
        delta, self._retried = value - self._retried, value
        if delta:
            self._endpoint.note("requests_retried", delta)


def build_producer(spec: ProducerSpec, *, servers: Optional[PoolHooks],
                   interrupted: Callable[[], bool]) -> tuple[BatchSource, LoopContext]:
    """The producer's batch source (not restored, not started) and its context (rank 0's as far
    as the rollout goes: no logger, no pool, no pusher)."""
    if spec.mode not in IN_PROCESS:
        raise ValueError(f"rollout.async: {spec.mode}: no producer process for this mode "
                         f"(modes: {sorted(IN_PROCESS)})")
    cfg = spec.cfg
    encoder = spec.sampler.dataset.encoder
    client = build_client(spec.client, servers=servers)
    ctx = LoopContext(
        cfg=cfg, run_dir=spec.run_dir, logger=MetricsLogger(spec.run_dir, enabled=False),
        stop=StopFlag(), sampler=spec.sampler,
        reward_fn=build_reward(cfg.reward, cfg.data, interrupted=interrupted),
        client=client, decode=encoder.decode, stop_token_ids=[encoder.eos_id],
        generator=build_generator(cfg, client, encoder, interrupted=interrupted))
    return IN_PROCESS[spec.mode](ctx, spec.start_step), ctx
