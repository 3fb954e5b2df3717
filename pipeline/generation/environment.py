"""The environment of a multi-turn rollout: what answers a model turn.

An environment is small: ``reset(prompt)`` gives the first turn's prompt tokens;
``step(text)`` takes the text of the model's turn and says what comes next: the text appended
as the next turn's context (a tool's output, with the chat template's glue), whether the
trajectory is done, and optionally its reward. The rollout (``pipeline.generation.multiturn``) owns the
tokens: it appends exactly the tokens the server generated and the tokens of the environment's
text, and never re-renders a history.

:class:`ToolEnvironment` is the one the run builds from ``tools.functions``: it parses the
turn's ``<tool_call>``s (``pipeline.generation.tool_calls``), runs them in the sandbox
(``pipeline.tools.sandbox.ToolExecutor``) and answers with their outputs; a turn without a call ends
the trajectory (``done``). A custom environment is ``tools.environment: "module:Class"``,
constructed as ``Class(executor=..., tool_format=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

from pipeline.generation.tool_calls import ToolFormat, parse_tool_calls

if TYPE_CHECKING:
    from pipeline.scoring.data import Prompt
    from pipeline.tools.sandbox import ToolExecutor


@dataclass
class EnvStep:
    """What the environment answers to one model turn."""

    observation: str = ""
    """Text appended after the turn (tokenized once, masked from the loss); "" when done."""
    done: bool = False
    end_reason: Optional[str] = None
    """When done: "done" (the model answered) or "tool_error" (the tool-time budget ran out)."""
    reward: Optional[float] = None
    """The trajectory's reward when done; None: the run's reward function scores the final turn."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    """The reason of each failed call (the sandbox's error kind, or "malformed")."""


class Environment(Protocol):
    def reset(self, prompt: "Prompt") -> list[int]:
        """Start a trajectory: the first turn's prompt tokens."""

    def step(self, text: str, *, tool_time_left_s: float) -> EnvStep:
        """The model's turn ``text``; ``tool_time_left_s``: what the trajectory's tool-time
        budget has left (a call may not run longer)."""


class ToolEnvironment:
    """Tool calls in, tool responses out; the first turn without a call ends the trajectory."""

    def __init__(self, *, executor: "ToolExecutor", tool_format: ToolFormat):
        self.executor = executor
        self.format = tool_format

    def reset(self, prompt: "Prompt") -> list[int]:
        return list(prompt.prompt_ids)

    def step(self, text: str, *, tool_time_left_s: float) -> EnvStep:
        parsed = parse_tool_calls(text)
        if not len(parsed):
            return EnvStep(done=True, end_reason="done")
        out = EnvStep()
        contents = []
        for call, error in zip(parsed.calls, parsed.errors):
            out.tool_calls += 1
            if call is None:
                out.tool_errors += 1
                out.errors.append("malformed")
                contents.append(error)
                continue
            left = tool_time_left_s - out.tool_seconds
            if left <= 0:
                out.tool_errors += 1
                out.errors.append("tool_time")
                contents.append("error: the trajectory's tool time budget is spent")
                continue
            outcome = self.executor.call(call.name, call.arguments, timeout_s=left)
            out.tool_seconds += outcome.seconds
            if not outcome.ok:
                out.tool_errors += 1
                out.errors.append(outcome.error or "error")
            contents.append(outcome.output)
        if out.tool_seconds >= tool_time_left_s or "tool_time" in out.errors:
            out.done, out.end_reason = True, "tool_error"
            return out
        out.observation = self.format.render(contents)
        return out
