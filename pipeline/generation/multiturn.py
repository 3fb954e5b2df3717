"""Multi-turn, tool-using rollouts: token-in / token-out trajectories with a loss mask.

A trajectory alternates model turns and environment answers (``pipeline.generation.environment``). Turn k's
request is ``prompt + everything so far`` as token ids: the ids the server generated in earlier
turns, exactly, and the ids of the environment's answers as tokenized once when they were
appended. Nothing is ever re-rendered from messages (a chat template re-render does not give
back the generated tokens: Qwen3's drops earlier ``<think>`` blocks and re-serialises tool-call
JSON; ``docs/tools.md``).

The result is one :class:`~pipeline.generation.trajectory.RolloutResult` whose ``output_ids``
are every turn's tokens and every answer's tokens in order, with ``output_mask`` 1 on the model's
tokens and 0 on the appended ones; ``output_logprobs`` are the server's on the model's tokens and
0.0 on the others; ``turns`` the model turns (:class:`~pipeline.generation.trajectory.Turn`),
``env_reward`` the environment's reward when it gave one. The training batch's
``response_mask`` is that mask, so GSPO's length normalisation and sequence ratio ``s_i`` are
taken over the model's tokens only.

All turns of a trajectory go to the same server (``pin``), so its prefix cache serves the earlier
turns (``cached_tokens`` per turn is recorded). With routing replay ``rollout`` each turn asks
for routed experts, and the trajectory's rows are composed so that row t comes from the first
turn that computed token t (the turn that generated it, or for an appended token and a turn's
last token the next turn's prefill), i.e. the routes the server used when it first ran the token.

Budgets end a trajectory: ``max_turns`` model turns, ``max_tokens`` output tokens (model and
appended), ``max_tool_time_s`` of tool wall time; ``end_reason`` records which
(:class:`~pipeline.generation.trajectory.EndReason`).

:class:`ToolGenerator` is the run's ``pipeline.generation.generator.GroupGenerator`` when
``tools`` is configured.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional, Sequence

import torch

from pipeline.generation.client import RolloutClient, SamplingParams, sample_seed, stream_seed
from pipeline.generation.environment import Environment, ToolEnvironment
from pipeline.generation.tool_calls import FORMATS
from pipeline.generation.trajectory import EndReason, RolloutResult, Span, Turn
from pipeline.scoring.rewards import RewardError, load_function
from pipeline.tools.sandbox import (ToolExecutor, ToolIsolationError, ToolLimits, load_tools,
                                    valid_text)

if TYPE_CHECKING:
    from pipeline.scoring.data import Prompt

TOOL_ERROR_KINDS = ("malformed", "tool_time", "timeout", "memory", "output_limit", "crash",
                    "network", "encoding", "error")
"""Why a call failed (``Turn.errors``): the parser's ``malformed``, the trajectory's tool time
spent (``tool_time``), or the sandbox's kind (``pipeline.tools.sandbox.ERROR_KINDS``)."""


@dataclass(frozen=True, kw_only=True)
class Budgets:
    max_turns: int
    max_tokens: Optional[int]
    """Output tokens per trajectory (model and appended); None: only ``fit_length`` bounds it."""
    max_tool_time_s: float
    fit_length: Optional[int] = None
    """The longest prompt + output a training row holds (run.seq_length + 1): the output budget
    is at most this minus the prompt's length."""

    def output_limit(self, prompt_len: int) -> int:
        limits = [x for x in (self.max_tokens,
                              None if self.fit_length is None else self.fit_length - prompt_len)
                  if x is not None]
        if not limits:
            raise ValueError("Budgets: give max_tokens or fit_length")
        return min(limits)


def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """Turn ``turn``'s sampling_seed from the sample's ``seed``: the sample's own for turn 0 (a
    one-turn trajectory samples what a plain request does), a seed derived from it for the
    others."""
    if seed is None or turn == 0:
        return seed
    return stream_seed("turn", seed, turn)


def compose_routes(parts: Sequence[Any]) -> Any:
    """The trajectory's routed experts from its turns' (each ``[rows_k, L, K]``, rows_k growing):
    row t from the first turn whose rows reach t. None if a turn has none."""
    if any(p is None for p in parts):
        return None
    rows = [parts[0]]
    have = parts[0].shape[0]
    for p in parts[1:]:
        if p.shape[0] > have:
            rows.append(p[have:])
            have = p.shape[0]
    return torch.cat(rows).contiguous()


async def run_trajectory(send: Callable[..., Awaitable[RolloutResult]], env: Environment,
                         prompt: Prompt, sampling: SamplingParams, budgets: Budgets, *,
                         rid: str, encode_text: Callable[[str], list[int]],
                         decode: Callable[[Sequence[int]], str],
                         routed_experts: Optional[tuple[int, int]] = None,
                         pin: Optional[str] = None) -> RolloutResult:
    """One trajectory; ``send(rid, input_ids, sampling, routed_experts=, pin=)`` is a request
    (``RolloutClient.session``)."""
    prompt_ids = list(await asyncio.to_thread(env.reset, prompt))
    limit = budgets.output_limit(len(prompt_ids))
    out: list[int] = []
    logprobs: list[float] = []
    mask: list[int] = []
    spans: list[Span] = []
    turns: list[Turn] = []
    routes = []
    tool_left = budgets.max_tool_time_s
    end, last, reward = EndReason.MAX_TURNS, None, None
    for k in range(budgets.max_turns):
        room = limit - len(out)
        if room <= 0:
            end = EndReason.MAX_TOKENS
            break
        sp = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, room),
                     sampling_seed=turn_seed(sampling.sampling_seed, k))
        r = await send(f"{rid}-t{k}", prompt_ids + out, sp, routed_experts=routed_experts,
                       pin=pin)
        last = r
        pin = r.server_url or pin  # stay where the trajectory went
        start = len(out)
        out += r.output_ids
        logprobs += r.output_logprobs
        mask += [1] * len(r.output_ids)
        spans += [Span(v, a + start, b + start) for v, a, b in r.weight_versions]
        routes.append(r.routed_experts)
        turn = Turn(start=start, length=len(r.output_ids), observation_length=0,
                    finish_reason=r.finish_reason, cached_tokens=r.cached_tokens,
                    prompt_tokens=len(prompt_ids) + start, server_url=r.server_url)
        turns.append(turn)
        if r.finish_reason == "abort":
            end = EndReason.ABORT
            break
        if r.finish_reason == "length" and len(out) >= limit:
            end = EndReason.MAX_TOKENS
            break
        step = await asyncio.to_thread(env.step, decode(r.output_ids), tool_time_left_s=tool_left)
        tool_left -= step.tool_seconds
        turn.tool_calls, turn.tool_errors = step.tool_calls, step.tool_errors
        turn.tool_seconds, turn.errors = step.tool_seconds, tuple(step.errors)
        if step.done:
            end, reward = _end_reason(step.end_reason), step.reward
            break
        if k == budgets.max_turns - 1:
            break  # no turn follows: the answer is not appended
        text, wrong = valid_text(step.observation)  # an environment's text is data, never a crash
        if wrong is not None:
            turn.tool_errors += 1
            turn.errors += ("encoding",)
        observation = encode_text(text)
        if len(out) + len(observation) >= limit:
            end = EndReason.MAX_TOKENS  # no room for the answer and a turn after it
            break
        out += observation
        logprobs += [0.0] * len(observation)
        mask += [0] * len(observation)
        turn.observation_length = len(observation)
    assert last is not None, "budgets.max_turns and max_tokens allow at least one turn"
    routed = compose_routes(routes) if routed_experts is not None else None
    return RolloutResult(
        rid=rid, prompt_ids=prompt_ids, output_ids=out, output_logprobs=logprobs,
        finish_reason=last.finish_reason, matched_stop=last.matched_stop,
        prompt_tokens=len(prompt_ids), completion_tokens=sum(mask),
        weight_version=last.weight_version, server_url=last.server_url,
        weight_versions=spans, routed_experts=routed,
        cached_tokens=sum(t.cached_tokens for t in turns), output_mask=mask, turns=turns,
        end_reason=end, env_reward=None if reward is None else float(reward))


def _end_reason(said: Optional[str]) -> EndReason:
    """A done environment's ``EnvStep.end_reason`` (None: done)."""
    try:
        return EndReason(said or EndReason.DONE)
    except ValueError:
        raise ValueError(f"EnvStep.end_reason {said!r}: expected one of "
                         f"{[e.value for e in EndReason]}") from None


async def generate_trajectory_groups(client: RolloutClient, prompts: Sequence[Prompt],
                                     group_size: int, sampling: SamplingParams, *,
                                     make_env: Callable[[], Environment], budgets: Budgets,
                                     encode_text: Callable[[str], list[int]],
                                     decode: Callable[[Sequence[int]], str],
                                     seed: Optional[int] = None, rid_prefix: str = "mt",
                                     routed_experts: Optional[tuple[int, int]] = None
                                     ) -> list[list[RolloutResult]]:
    """G trajectories per prompt (prompt-major), each on one server (a direct client of the
    router's workers in router mode: the pick is ours, the router's policy does not see turns)."""
    direct = await client.direct_client()
    base = seed if seed is not None else random.getrandbits(62)
    async with direct.session() as send:
        tasks = []
        for p, prompt in enumerate(prompts):
            for s in range(group_size):
                sp = replace(sampling, n=1, sampling_seed=sample_seed(base, p, s))
                tasks.append(run_trajectory(send, make_env(), prompt, sp, budgets,
                                            rid=f"{rid_prefix}-p{p}-s{s}", encode_text=encode_text,
                                            decode=decode, routed_experts=routed_experts,
                                            pin=direct.pick_server()))
        results = list(await asyncio.gather(*tasks))
    return [results[p * group_size:(p + 1) * group_size] for p in range(len(prompts))]


def trajectory_metrics(results: Sequence[RolloutResult]) -> dict[str, float]:
    """Per-batch means over trajectories (verl's names where it has them: ``num_turns``,
    ``tool_calls``), failed calls by reason, the share of each end reason; masked vs trained
    tokens; prefix-cache hits of the turns after the first."""
    if not results:
        return {}
    n = len(results)
    out = {
        "num_turns/mean": sum(len(r.turns) for r in results) / n,
        "num_turns/max": float(max(len(r.turns) for r in results)),
        "tool_calls/mean": sum(t.tool_calls for r in results for t in r.turns) / n,
        "tool_errors/mean": sum(t.tool_errors for r in results for t in r.turns) / n,
        "tool_time_s/mean": sum(t.tool_seconds for r in results for t in r.turns) / n,
        "trained_tokens": float(sum(sum(r.output_mask) for r in results)),
        "masked_tokens": float(sum(len(r.output_mask) - sum(r.output_mask) for r in results)),
    }
    for kind in TOOL_ERROR_KINDS:  # failed calls by reason, per trajectory
        out[f"tool_errors/{kind}"] = sum(t.errors.count(kind) for r in results
                                         for t in r.turns) / n
    later = [t for r in results for t in r.turns[1:]]
    if later:  # the prefix cache on the turns after the first (sticky sessions)
        out["cached_tokens_per_turn"] = sum(t.cached_tokens for t in later) / len(later)
        out["cached_frac_per_turn"] = (sum(t.cached_tokens for t in later)
                                       / max(1, sum(t.prompt_tokens for t in later)))
    for reason in EndReason:
        out[f"end_reason/{reason.value}"] = sum(r.end_reason == reason for r in results) / n
    return out


def load_environment(spec: Optional[str]) -> Optional[type]:
    """The class named by ``tools.environment`` (None for none); ValueError naming the field."""
    if spec is None:
        return None
    try:
        cls = load_function(spec)
    except RewardError as err:
        raise ValueError(f"tools.environment: {str(err).replace('reward.function ', '')}") from err
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"tools.environment {spec!r}: not an environment class (it needs "
                         f"reset(prompt) and step(text, *, tool_time_left_s); "
                         f"{'missing ' + ', '.join(missing) if missing else 'not a class'})")
    return cls


def make_executor(tools: Any, *, interrupted: Optional[Callable[[], bool]] = None,
                  workers: Optional[int] = None) -> ToolExecutor:
    """The sandbox of the ``tools`` section (ValueError naming ``tools.functions[i]``)."""
    return ToolExecutor(load_tools(tools.functions),
                        ToolLimits(timeout_s=tools.timeout_s, memory_mb=tools.memory_mb,
                                   output_bytes=tools.output_bytes),
                        workers=workers or tools.workers, isolation=tools.isolation,
                        pass_env=tools.pass_env, interrupted=interrupted)


def check_tools(tools: Any, *, probe: bool = True) -> None:
    """Preflight of the ``tools`` section: every tool and the environment import, and (``probe``)
    one sandbox worker starts under ``tools.isolation`` on this machine (ValueError naming
    ``tools.functions[i]``, ``tools.environment`` or ``tools.isolation``)."""
    executor = make_executor(tools, workers=1)
    try:
        load_environment(tools.environment)
        if probe:
            executor.check()
    except (ToolIsolationError, RuntimeError) as err:
        raise ValueError(str(err)) from err
    finally:
        executor.close()


class ToolGenerator:
    """Rank 0, ``tools`` configured: the run's ``GroupGenerator``
    (``pipeline.generation.generator``) of tool-using trajectories, with its sandbox,
    environment and budgets. ``interrupted``: the rank's "a stop signal came"; then every tool
    call waiting or running is abandoned and raises ``pipeline.tools.sandbox.ToolsInterrupted``
    (the rollout fails, the step guard saves and stops: within a poll of the signal, not after
    the calls' timeouts). A trajectory stopped in flight is not continued token by token
    (its environment's state is not saved): it is generated again (``docs/async.md``)."""

    def __init__(self, cfg: Any, client: RolloutClient, *,
                 encode_text: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str],
                 interrupted: Optional[Callable[[], bool]] = None):
        tools = cfg.tools
        env_class = load_environment(tools.environment)
        self.client = client
        # interrupted: the rank's stop flag; a stop abandons the tool calls in flight at once
        self.executor = make_executor(tools, interrupted=interrupted)
        fmt = FORMATS[tools.format]
        if env_class is not None:  # one environment per trajectory (it may keep state)
            self.make_env = lambda: env_class(executor=self.executor, tool_format=fmt)
        else:
            shared = ToolEnvironment(executor=self.executor, tool_format=fmt)  # stateless
            self.make_env = lambda: shared
        self.budgets = Budgets(max_turns=tools.max_turns, max_tokens=tools.max_tokens,
                               max_tool_time_s=tools.max_tool_time_s,
                               fit_length=cfg.run.seq_length + 1)
        self.encode_text, self.decode = encode_text, decode

    def generate(self, prompts: Sequence[Prompt], group_size: int, sampling: SamplingParams, *,
                 seed: int, rid_prefix: str,
                 routed_experts: Optional[tuple[int, int]] = None) -> list[list[RolloutResult]]:
        return asyncio.run(self.generate_async(prompts, group_size, sampling, seed=seed,
                                               rid_prefix=rid_prefix,
                                               routed_experts=routed_experts))

    async def generate_async(self, prompts: Sequence[Prompt], group_size: int,
                             sampling: SamplingParams, *, seed: int, rid_prefix: str,
                             routed_experts: Optional[tuple[int, int]] = None
                             ) -> list[list[RolloutResult]]:
        return await generate_trajectory_groups(
            self.client, prompts, group_size, sampling, make_env=self.make_env,
            budgets=self.budgets, encode_text=self.encode_text, decode=self.decode, seed=seed,
            rid_prefix=rid_prefix, routed_experts=routed_experts)

    def can_continue(self) -> bool:
        return False

    async def continue_group(self, prompt: Prompt, partial: Sequence[RolloutResult],
                             sampling: SamplingParams, *, seed: int, rid_prefix: str,
                             routed_experts: Optional[tuple[int, int]] = None
                             ) -> list[RolloutResult]:
        raise NotImplementedError("ToolGenerator.continue_group: a multi-turn trajectory is "
                                  "generated again, not continued (can_continue() is False)")

    async def abort_all(self) -> None:
        await self.client.abort_all()

    def metrics(self, results: Sequence[RolloutResult]) -> dict[str, float]:
        return trajectory_metrics(results)

    def close(self) -> None:
        self.executor.close()
