"""A sample stopped part-way (aborted with its output so far: a weight sync in ``abort`` mode, a
checkpoint of the ``full`` stream) continued from there: :func:`continue_samples` sends prompt +
output so far as a new prompt with the tokens it had left, :func:`join_continuation` joins the two
into one sample. The same for every engine (the requests go through ``RolloutClient``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Optional

from pipeline.generation.client import (RolloutClient, SamplingParams, sample_seed,
                                        stream_seed)
from pipeline.generation.trajectory import RolloutResult, Span


def join_continuation(partial: RolloutResult, cont: RolloutResult) -> RolloutResult:
    """A sample stopped part-way (``partial``: aborted with its output so far) and the request
    that continued it (``cont``: ``partial``'s prompt + output as its prompt) as one sample:
    output ids and log-probs appended, ``weight_versions`` spans shifted behind the partial's
    (a span of the same version as the partial's last one is merged with it), the finish reason,
    server and routed experts of the continuation. The routed experts are replaced, not appended:
    the continuation's prefill routed the partial's tokens again (SGLang returns the routes of the
    last prefill and the decode steps after it, as after a ``retract``), so they are the routes of
    ``cont``'s weights for every position of the joined sequence (its row count,
    ``len(prompt) + len(output) - 1``, is the joined sample's). The joined sample is one turn
    over its whole output."""
    if len(partial.turns) != 1 or not all(partial.output_mask):
        raise ValueError(f"{partial.rid}: a multi-turn trajectory is not continued token by token")
    if list(cont.prompt_ids) != list(partial.prompt_ids) + list(partial.output_ids):
        raise ValueError(f"{cont.rid}: the continuation's prompt is not {partial.rid}'s prompt "
                         "and output so far")
    n = len(partial.output_ids)
    spans = list(partial.weight_versions)
    for version, start, end in cont.weight_versions:
        if spans and spans[-1].version == version and spans[-1].end == start + n:
            spans[-1] = Span(version, spans[-1].start, end + n)
        else:
            spans.append(Span(version, start + n, end + n))
    return replace(cont, rid=partial.rid, prompt_ids=list(partial.prompt_ids),
                   output_ids=list(partial.output_ids) + list(cont.output_ids),
                   output_logprobs=list(partial.output_logprobs) + list(cont.output_logprobs),
                   prompt_tokens=partial.prompt_tokens,
                   completion_tokens=partial.completion_tokens + cont.completion_tokens,
                   weight_versions=spans, cached_tokens=partial.cached_tokens + cont.cached_tokens,
                   output_mask=None, turns=None, end_reason=None)  # one turn, from these fields


async def continue_samples(client: RolloutClient, prompt_ids: Sequence[int],
                           partial: Sequence[RolloutResult], sampling: SamplingParams, *,
                           seed: int, rid_prefix: str,
                           routed_experts: Optional[tuple[int, int]] = None
                           ) -> list[RolloutResult]:
    """Continue the aborted samples of one group from their output so far (finished ones are
    returned as they are): one request each whose prompt is ``prompt_ids`` + the sample's output
    and whose ``max_new_tokens`` is what the sample had left; joined with
    :func:`join_continuation`. ``seed``: the base of the continuation's sampling seeds (distinct
    per sample). A continuation aborted in turn comes back aborted, with the longer output."""
    stopped = [i for i, r in enumerate(partial) if r.finish_reason == "abort"]
    requests = []
    for i in stopped:
        r = partial[i]
        left = sampling.max_new_tokens - len(r.output_ids)
        if left < 1:
            raise ValueError(f"{r.rid}: aborted with {len(r.output_ids)} output tokens, "
                             f"max_new_tokens {sampling.max_new_tokens}: nothing left to continue")
        requests.append((f"{rid_prefix}-s{i}", list(prompt_ids) + list(r.output_ids),
                         replace(sampling, n=1, max_new_tokens=left,
                                 sampling_seed=sample_seed(stream_seed("continue", seed, i),
                                                           0, 0))))
    conts = await client.generate(requests, routed_experts=routed_experts) if requests else []
    out = list(partial)
    for i, cont in zip(stopped, conts):
        out[i] = join_continuation(partial[i], cont)
    return out
