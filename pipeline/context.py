"""What the GSPO step works with besides its batch source: :class:`LoopContext` (built by
``launch.rl_session.RLSession``) and the :class:`Trainer` protocol the Megatron side implements
(``megatron_gspo.train.rl_trainer.RLTrainer``).

It sits below ``pipeline.step`` and ``pipeline.sources``: both read the context, neither is
imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch.distributed as dist

from megatron_gspo.config import Config
from pipeline.generation.generator import GroupGenerator, SingleTurnGenerator
from pipeline.generation.version import WeightVersion
from pipeline.observe.metrics import MetricsLogger
from pipeline.signals import StopFlag

if TYPE_CHECKING:
    from pipeline.generation.client import RolloutClient
    from pipeline.engines.factory import ClientSpec
    from pipeline.scoring.data import Prompt, PromptSampler
    from pipeline.scoring.rewards import RewardFn
    from pipeline.servers.pool import ServerPool
    from pipeline.weights.parity import ParityWatchdog
    from pipeline.weights.push import WeightPusher


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
    """What the loop needs besides the trainer and the batch source; built by
    ``launch.rl_session.RLSession``.

    The fields marked "rank 0" are used on global rank 0 only (None / empty elsewhere). The
    collaborators come first; the last three fields are the run's mutable state: the live
    servers (``server_urls``, renewed by each pool check) and what :func:`pipeline.step.loop.run`
    sets (``resync``, ``weights_version``)."""

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
    servers: Optional[ServerPool] = None
    """Rank 0: which servers are alive (``pipeline.servers.pool``): checked before every weight
    sync, dead ones dropped and (embedded) restarted. None: every server, always."""
    parity: Optional[ParityWatchdog] = None
    """Every rank, with parity.enabled: the watchdog run after every weight sync
    (``pipeline.step.phases.check_parity``); rank 0's holds the probe prompts."""
    generator: Optional[GroupGenerator] = None
    """Rank 0: the run's generator of every training and evaluation sample
    (``pipeline.generation.generator``; with ``tools`` configured, multi-turn trajectories);
    left out: a ``SingleTurnGenerator`` over ``client``."""
    engine: Optional[ClientSpec] = None
    """Rank 0: how ``client`` was built (``pipeline.engines.factory``), so that another
    process can build its own: the rollout producer of ``rollout.async: one_step`` / ``full``
    (``pipeline.sources.remote``). None: those modes run their producer on a thread of this
    process (``pipeline.sources.choice.make_source``; the tests' in-process fakes)."""

    # --- the run's mutable state
    server_urls: list[str] = field(default_factory=list)
    """Rank 0: every live rollout server (release / resume of colocated servers' memory, the
    parity probes); ``pipeline.step.phases.sync_weights`` renews it from the pool's check."""
    resync: Optional[Callable[[WeightVersion], Any]] = None
    """Every rank, set by ``pipeline.step.loop.run``: ``resync(version)`` syncs the trainer's
    weights (``pipeline.step.phases.sync_weights``) - what rank 0's rollout has every rank do
    mid-phase when servers it restarted need the current weights (``ServerPool.wait_for_live``,
    :func:`pipeline.step.rank0.run_on_rank0`)."""
    weights_version: WeightVersion = 0
    """Rank 0, set by ``pipeline.step.loop.run``: the version of the weights the trainer holds
    now (read by the resync channel on the thread that waits for a live server)."""

    def __post_init__(self) -> None:
        if self.generator is None and self.client is not None:
            self.generator = SingleTurnGenerator(self.client)
