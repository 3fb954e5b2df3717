"""One generation seam: a :class:`GroupGenerator` turns prompts into groups of samples.

The run chooses its generator once (``launch.rl_session.RLSession.build_rollout``): a
:class:`SingleTurnGenerator` (one ``/generate`` request per sample), or with ``tools``
configured a ``pipeline.generation.multiturn.ToolGenerator`` (a tool-using trajectory per
sample). The step's phases, evaluation and the ``full`` stream call it without knowing which:
every sample is a ``pipeline.generation.trajectory.RolloutResult``, a one-turn trajectory or a
longer one.

    groups = generator.generate(prompts, G, sampling, seed=seed, rid_prefix="s3r0")
    if generator.can_continue():   # the stream's checkpoint keeps the output of requests in flight
        group = await generator.continue_group(prompt, partial, sampling, seed=s, rid_prefix="c")
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional, Protocol

from pipeline.generation.client import RolloutClient, SamplingParams
from pipeline.generation.continuation import continue_samples
from pipeline.generation.trajectory import RolloutResult

if TYPE_CHECKING:
    from pipeline.scoring.data import Prompt


class GroupGenerator(Protocol):
    """G samples of each prompt. ``seed``: the base of the samples' sampling seeds
    (``pipeline.generation.client.sample_seed(seed, prompt, sample)``); ``rid_prefix``: the
    requests' rids start with it; ``routed_experts=(num_layers, top_k)``: every sample carries
    the experts the servers routed its tokens to (routing replay ``rollout``)."""

    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams, *,
                 seed: int, rid_prefix: str,
                 routed_experts: Optional[tuple[int, int]] = None) -> list[list[RolloutResult]]:
        """The groups, prompt-major, one per prompt (blocking)."""

    async def generate_async(self, prompts: Sequence[Prompt], group_size: int,
                             sampling: SamplingParams, *, seed: int, rid_prefix: str,
                             routed_experts: Optional[tuple[int, int]] = None
                             ) -> list[list[RolloutResult]]:
        """:meth:`generate` on the caller's event loop."""

    def can_continue(self) -> bool:
        """Whether :meth:`continue_group` continues an aborted sample from its output so far
        (otherwise a group stopped in flight is generated again)."""

    async def continue_group(self, prompt: Prompt, partial: Sequence[RolloutResult],
                             sampling: SamplingParams, *, seed: int, rid_prefix: str,
                             routed_experts: Optional[tuple[int, int]] = None
                             ) -> list[RolloutResult]:
        """The group ``partial`` (its finished samples as they are, the others aborted with
        their output so far) with the aborted samples continued; only if :meth:`can_continue`."""

    async def abort_all(self) -> None:
        """Abort every request on the servers (each answers with its output so far)."""

    def metrics(self, results: Sequence[RolloutResult]) -> dict[str, float]:
        """The generator's own per-batch metrics of ``results`` ({}: none)."""


class SingleTurnGenerator:
    """One ``/generate`` request per sample (``RolloutClient.generate_groups``); an aborted
    sample is continued from its output so far (``pipeline.generation.continuation.continue_samples``)."""

    def __init__(self, client: RolloutClient):
        self.client = client

    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams, *,
                 seed: int, rid_prefix: str,
                 routed_experts: Optional[tuple[int, int]] = None) -> list[list[RolloutResult]]:
        return self.client.generate_groups([p.prompt_ids for p in prompts], group_size, sampling,
                                           seed=seed, rid_prefix=rid_prefix,
                                           routed_experts=routed_experts)

    async def generate_async(self, prompts: Sequence[Prompt], group_size: int,
                             sampling: SamplingParams, *, seed: int, rid_prefix: str,
                             routed_experts: Optional[tuple[int, int]] = None
                             ) -> list[list[RolloutResult]]:
        return await self.client.generate_groups_async(
            [p.prompt_ids for p in prompts], group_size, sampling, seed=seed,
            rid_prefix=rid_prefix, routed_experts=routed_experts)

    def can_continue(self) -> bool:
        return True

    async def continue_group(self, prompt: Prompt, partial: Sequence[RolloutResult],
                             sampling: SamplingParams, *, seed: int, rid_prefix: str,
                             routed_experts: Optional[tuple[int, int]] = None
                             ) -> list[RolloutResult]:
        return await continue_samples(self.client, prompt.prompt_ids, partial, sampling,
                                      seed=seed, rid_prefix=rid_prefix,
                                      routed_experts=routed_experts)

    async def abort_all(self) -> None:
        await self.client.abort_all()

    def metrics(self, results: Sequence[RolloutResult]) -> dict[str, float]:
        return {}
