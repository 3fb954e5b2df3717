"""The sample type: one prompt's rollout, a trajectory of one or more model turns.

Every sample the pipeline generates is a :class:`RolloutResult`, whichever generator made it
(``pipeline.generation.generator``): a plain ``/generate`` request is a one-turn trajectory whose
``output_mask`` is all ones; a tool-using rollout (``pipeline.generation.multiturn``) is a
trajectory whose ``output_ids`` are its model turns and the environment's answers in order, with
``output_mask`` 0 on the answers. The trainer sees ``prompt_ids``, ``output_ids``,
``output_logprobs`` and ``output_mask`` (``megatron_gspo.train.batching.rl_batch``) and never
learns that a turn exists.

Typed fields, the same for both: ``turns`` (:class:`Turn`, offsets into ``output_ids``),
``end_reason`` (:class:`EndReason`), ``env_reward`` (the environment's reward, or None) and
``weight_versions`` (:class:`Span`, int versions: ``pipeline.generation.version``).

JSON (:func:`result_to_json` / :func:`result_from_json`): the ``full`` stream's checkpoint holds
the samples of its buffer; the routed experts stay a tensor there (the checkpoint writes it to
``run_state.safetensors``, ``megatron_gspo.train.checkpoint.run_state``). :func:`result_from_json`
also reads what earlier versions wrote: version labels as strings, routed experts as nested
lists, ``output_mask`` / ``turns`` / ``end_reason`` null for a one-turn sample, turns as dicts
with the environment's reward as a ``"reward"`` key of the last one.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, NamedTuple, Optional

import torch

from pipeline.generation.version import WeightVersion, from_wire

FinishReason = Literal["stop", "length", "abort"]
"""SGLang's ``meta_info.finish_reason.type`` of one request."""


class EndReason(enum.StrEnum):
    """Why a trajectory ended (the metrics' ``end_reason/<value>``)."""

    DONE = "done"
    """The model answered: its turn stopped (one turn) or the environment said done."""
    MAX_TURNS = "max_turns"
    MAX_TOKENS = "max_tokens"
    """The output budget ran out (one turn: ``max_new_tokens``)."""
    TOOL_ERROR = "tool_error"
    """The trajectory's tool-time budget ran out."""
    ABORT = "abort"
    """A request was aborted (a checkpoint, a dead server, an operator)."""

    @classmethod
    def of_request(cls, finish_reason: FinishReason) -> EndReason:
        """The end of a one-turn sample, from its request's finish reason."""
        return {"stop": cls.DONE, "length": cls.MAX_TOKENS, "abort": cls.ABORT}[finish_reason]


class Span(NamedTuple):
    """Output tokens ``[start, end)`` generated with the weights of ``version`` (None: the
    server's label was not a step number, e.g. its initial one)."""

    version: Optional[WeightVersion]
    start: int
    end: int


@dataclass
class Turn:
    """One model turn of a trajectory (offsets into the trajectory's ``output_ids``)."""

    start: int
    length: int
    observation_length: int
    """Tokens of the environment's answer appended after the turn (masked from the loss)."""
    finish_reason: FinishReason
    cached_tokens: int
    """Prompt tokens of the turn's request that the server's prefix cache served."""
    prompt_tokens: int
    """The turn's request: prompt + the trajectory so far."""
    server_url: str
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    errors: tuple[str, ...] = ()
    """The reason of each failed call (``pipeline.generation.multiturn.TOOL_ERROR_KINDS``)."""


@dataclass
class RolloutResult:
    """One sample: a trajectory of one or more model turns (see the module docstring).
    ``output_ids`` ends with the stop token when one matched (as in SGLang).

    ``output_mask``, ``turns`` and ``end_reason`` left out (None) are a one-turn sample's: all
    ones, one :class:`Turn` over the whole output, and :meth:`EndReason.of_request`."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    """One per output id: SGLang's output_token_logprobs (temperature-scaled distribution); 0.0
    on the tokens the model did not generate."""
    finish_reason: FinishReason
    """The last request's."""
    matched_stop: Optional[int | str]
    prompt_tokens: int
    completion_tokens: int
    """Tokens the model generated (``output_mask``'s ones)."""
    weight_version: Optional[WeightVersion]
    """``meta_info.weight_version`` of the last request: the version of the server's weights
    when it finished (None: not a step number)."""
    server_url: str
    weight_versions: list[Span] = field(default_factory=list)
    """SGLang 0.5.23's ``meta_info.weight_versions``: spans over ``output_ids`` in order that
    cover the model's tokens (a request that lived through weight updates, e.g. retracted and
    resumed, has one span per version; a trajectory one or more per turn, none over the
    environment's answers; ``[]`` for a sample with no output)."""
    routed_experts: Optional[torch.Tensor] = None
    """Asked for (``routed_experts=(L, K)``): int32 ``[len(prompt_ids) + len(output_ids) - 1,
    L, K]``, row t = the experts every layer routed token t of ``prompt_ids + output_ids`` to on
    the server; None when not asked for (or an aborted sample without them)."""
    cached_tokens: int = 0
    """``meta_info.cached_tokens``: prompt tokens the server's prefix cache served (summed over
    the turns)."""
    output_mask: list[int] = None  # type: ignore[assignment]  # None -> all ones (__post_init__)
    """One 0/1 per output id: 1 where the model generated the token (trained), 0 for the
    environment's answers and template glue (masked)."""
    turns: list[Turn] = None  # type: ignore[assignment]  # None -> one turn (__post_init__)
    end_reason: EndReason = None  # type: ignore[assignment]  # None -> of_request (__post_init__)
    env_reward: Optional[float] = None
    """The reward the environment gave when the trajectory ended (None: the run's reward
    function scores :meth:`final_turn_ids`)."""

    def __post_init__(self) -> None:
        if self.output_mask is None:
            self.output_mask = [1] * len(self.output_ids)
        if len(self.output_mask) != len(self.output_ids):
            raise ValueError(f"sample {self.rid}: output_mask has {len(self.output_mask)} values "
                             f"for {len(self.output_ids)} output ids")
        if self.turns is None:
            self.turns = [Turn(start=0, length=len(self.output_ids), observation_length=0,
                               finish_reason=self.finish_reason, cached_tokens=self.cached_tokens,
                               prompt_tokens=self.prompt_tokens, server_url=self.server_url)]
        self.end_reason = (EndReason.of_request(self.finish_reason) if self.end_reason is None
                           else EndReason(self.end_reason))

    def final_turn_ids(self) -> list[int]:
        """The tokens of the last model turn (what the reward function scores): the whole
        output of a one-turn sample."""
        last = self.turns[-1]
        return list(self.output_ids[last.start:last.start + last.length])


def result_to_json(r: RolloutResult) -> dict:
    """A sample as JSON but for its routed experts, a tensor (a checkpoint of the ``full`` mode's
    buffer; bit-exact: floats as JSON numbers round-trip, the tensor into the checkpoint's
    ``run_state.safetensors``)."""
    return {
        "rid": r.rid, "prompt_ids": list(r.prompt_ids), "output_ids": list(r.output_ids),
        "output_logprobs": list(r.output_logprobs), "finish_reason": r.finish_reason,
        "matched_stop": r.matched_stop, "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens, "weight_version": r.weight_version,
        "server_url": r.server_url, "weight_versions": [list(s) for s in r.weight_versions],
        "routed_experts": r.routed_experts,  # a tensor: the checkpoint writes it as one
        "cached_tokens": r.cached_tokens, "output_mask": list(r.output_mask),
        "turns": [{**asdict(t), "errors": list(t.errors)} for t in r.turns],
        "end_reason": r.end_reason.value, "env_reward": r.env_reward,
    }


def result_from_json(d: dict) -> RolloutResult:
    """:func:`result_to_json`'s sample back, or one an earlier version wrote (module docstring)."""
    routed = d.get("routed_experts")
    turns = d.get("turns")
    env_reward = d.get("env_reward")
    if turns and env_reward is None and "reward" in turns[-1]:  # written before env_reward
        env_reward = turns[-1]["reward"]
    return RolloutResult(
        rid=d["rid"], prompt_ids=list(d["prompt_ids"]), output_ids=list(d["output_ids"]),
        output_logprobs=[float(x) for x in d["output_logprobs"]],
        finish_reason=d["finish_reason"], matched_stop=d["matched_stop"],
        prompt_tokens=int(d["prompt_tokens"]), completion_tokens=int(d["completion_tokens"]),
        weight_version=_version(d["weight_version"]), server_url=d["server_url"],
        weight_versions=[Span(_version(v), int(a), int(b)) for v, a, b in d["weight_versions"]],
        routed_experts=None if routed is None else torch.as_tensor(routed, dtype=torch.int32),
        cached_tokens=int(d.get("cached_tokens", 0)),
        output_mask=None if d.get("output_mask") is None else [int(x) for x in d["output_mask"]],
        turns=None if turns is None else [_turn_from_json(t) for t in turns],
        end_reason=d.get("end_reason"),
        env_reward=None if env_reward is None else float(env_reward))


def _version(value: Any) -> Optional[WeightVersion]:
    """A version as JSON: an int or null, or a server's label (written before versions were
    ints)."""
    return from_wire(value) if isinstance(value, str) else value if value is None else int(value)


_TURN_FIELDS = tuple(f.name for f in fields(Turn))


def _turn_from_json(d: dict) -> Turn:
    turn = Turn(**{k: d[k] for k in _TURN_FIELDS if k in d})
    turn.errors = tuple(turn.errors)
    return turn
