"""Tool calls in a model's text, and the text a turn's tool results are appended as.

The call format is Qwen3's (its chat template's system prompt asks for it; SGLang's and vLLM's
``qwen25`` / ``hermes`` parsers read it): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
whitespace around the JSON allowed, ``arguments`` an object (or a JSON string of one, as some
models write it), several calls in one turn in order.

A malformed call is not dropped silently: :func:`parse_tool_calls` returns an error message for
it (whatever the text: not JSON, nested past :data:`MAX_NESTING`, an integer past Python's
digit limit - model output is data, the parser never raises), which the environment sends back
to the model as that call's tool response (so the policy is
trained on the consequence of the mistake, and the text tells it what the format is).

:class:`ToolFormat` is how results are appended: token-in / token-out, the trajectory is never
re-rendered from messages (``docs/tools.md`` says why); the appended text is exactly what Qwen3's
chat template renders for a run of ``tool`` messages followed by the generation prompt.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)
FORMAT_HINT = '<tool_call>{"name": <tool name>, "arguments": {<argument>: <value>, ...}}</tool_call>'
MAX_NESTING = 64
"""The deepest nesting of lists and objects a call may have; a deeper one is malformed (the
parser, the sandbox's JSON and a tool's own code all recurse on it)."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedCalls:
    """The calls of one model turn, in order; ``errors[i]`` is not None where call i was
    malformed (then ``calls[i]`` is None)."""

    calls: list[ToolCall | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.calls)


def _depth_over(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` levels deep (no recursion)."""
    todo = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                return True
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return False


def _load(text: str) -> tuple[Any, str | None]:
    """``text`` as JSON, or why not. Whatever the model wrote: JSON nested past the parser's
    recursion limit, integers past Python's digit limit (4300) and any other error of the parser
    are a reason, never an exception; so is nesting past :data:`MAX_NESTING`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at character {err.pos})"
    except RecursionError:
        return None, f"nested more than {MAX_NESTING} levels deep"
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        return None, f"not valid JSON ({str(err).split(';')[0]})"
    if _depth_over(value, MAX_NESTING):
        return None, f"nested more than {MAX_NESTING} levels deep"
    return value, None


def _one(body: str) -> tuple[ToolCall | None, str | None]:
    obj, why = _load(body)
    if why is not None:
        return None, f"error: the tool call is {why}; write {FORMAT_HINT}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, f'error: a tool call needs a "name" string; write {FORMAT_HINT}'
    args = obj.get("arguments", {})
    if isinstance(args, str):  # arguments as a JSON string of an object
        args, why = _load(args)
        if why is not None:
            return None, (f'error: "arguments" must be a JSON object (it is {why}); '
                          f'write {FORMAT_HINT}')
    if not isinstance(args, dict):
        return None, f'error: "arguments" must be a JSON object; write {FORMAT_HINT}'
    return ToolCall(obj["name"], args), None


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order; an opened call that is never
    closed is one malformed call."""
    out = ParsedCalls()
    end = 0
    for match in _CALL.finditer(text):
        call, error = _one(match.group(1).strip())
        out.calls.append(call)
        out.errors.append(error)
        end = match.end()
    if OPEN in text[end:]:
        out.calls.append(None)
        out.errors.append(f"error: {OPEN} was not closed by {CLOSE}; write {FORMAT_HINT}")
    return out


@dataclass(frozen=True)
class ToolFormat:
    """The text appended after a model turn for its tool results: ``open`` + for each result
    ``item_open + content + item_close`` + ``close`` (the next turn's generation prompt)."""

    name: str
    open: str
    item_open: str
    item_close: str
    close: str

    def render(self, contents: Sequence[str]) -> str:
        return self.open + "".join(self.item_open + c + self.item_close for c in contents) + self.close


FORMATS = {
    # Qwen3's chat template: the assistant turn ends with <|im_end|> (the stop token the model
    # generated); then "\n", one user turn holding every <tool_response>, the generation prompt
    "qwen3": ToolFormat("qwen3", open="\n<|im_start|>user", item_open="\n<tool_response>\n",
                        item_close="\n</tool_response>", close="<|im_end|>\n<|im_start|>assistant\n"),
    # a byte-level vocabulary without special tokens (the CPU demo's): the turn ended with its
    # stop token, the results follow directly
    "plain": ToolFormat("plain", open="", item_open="<tool_response>",
                        item_close="</tool_response>", close=""),
}
