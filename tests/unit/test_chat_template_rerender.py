"""Why multi-turn rollouts are token-in / token-out (docs/tools.md): re-rendering a trajectory's
messages with a Qwen3-style chat template does not give back the tokens the model generated.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_chat_template_rerender.py``

The template below follows Qwen3's (its logic, written out here: no hub download): tool calls are
re-serialised from the parsed ``arguments`` with ``tojson``, ``reasoning_content`` is rendered
only for assistant turns after the last real user query, tool results are merged into one user
turn. It runs through transformers' own chat-template machinery (``apply_chat_template``) on a
byte-level tokenizer. A trajectory built token-in / token-out (``pipeline.generation.multiturn``, the
``qwen3`` tool format) keeps exactly the sampled tokens; the re-render changes the model's own
turn (the JSON it wrote), and once a later user turn exists it drops the earlier ``<think>``
block, so the earlier turns are no longer a prefix of the rendered history (prime-rl #1334).
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.scoring.data import Prompt
from pipeline.generation.environment import ToolEnvironment
from pipeline.generation.multiturn import Budgets, run_trajectory
from pipeline.generation.client import RolloutResult, SamplingParams
from pipeline.tools.sandbox import ToolExecutor, ToolLimits, load_tools
from pipeline.scoring.tasks import decode, encode, write_byte_tokenizer
from pipeline.generation.tool_calls import FORMATS, parse_tool_calls

QWEN3_LIKE_TEMPLATE = r"""
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning_content %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {{- tool_call.arguments | tojson }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

END = "<|im_end|>"
# what the model generated (sampled tokens): compact JSON, as a model may well write it
TURN1 = ('<think>\nI need the sum.\n</think>\n\n'
         '<tool_call>\n{"name":"add","arguments":{"a":12,"b":30}}\n</tool_call>' + END)
TURN2 = "<think>\nThe tool says 42.\n</think>\n\nThe answer is 42." + END
PROMPT = "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("byte_tok")
    write_byte_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    return tok


def render(tokenizer, messages, **kw) -> list[int]:
    """The template's text through transformers, as byte ids (the byte tokenizer's ids)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert isinstance(text, str)
    return encode(text)


def messages_of(turn1: str, tool_result: str, turn2: str) -> list[dict]:
    """The trajectory as chat messages (what an agent framework keeps), parsed from the turns."""
    call = parse_tool_calls(turn1).calls[0]

    def split(turn):
        think, _, rest = turn.removesuffix(END).partition("</think>")
        return think.removeprefix("<think>").strip("\n"), rest.lstrip("\n")
    r1, c1 = split(turn1)
    r2, c2 = split(turn2)
    return [{"role": "user", "content": "What is 12+30?"},
            {"role": "assistant", "content": "", "reasoning_content": r1,
             "tool_calls": [{"type": "function", "function": {"name": call.name,
                                                              "arguments": call.arguments}}]},
            {"role": "tool", "content": tool_result},
            {"role": "assistant", "content": c2, "reasoning_content": r2}]


class Scripted:
    def __init__(self, turns):
        self.turns = turns

    async def __call__(self, rid, ids, sampling, *, routed_experts=None, pin=None):
        out = encode(self.turns.pop(0))
        return RolloutResult(rid=rid, prompt_ids=list(ids), output_ids=out,
                             output_logprobs=[-0.5] * len(out), finish_reason="stop",
                             matched_stop=None, prompt_tokens=len(ids),
                             completion_tokens=len(out), weight_version="0", server_url="s",
                             weight_versions=[("0", 0, len(out))])


@pytest.fixture(scope="module")
def tito():
    """The token-in / token-out trajectory of TURN1, the calculator's answer, TURN2."""
    with ToolExecutor(load_tools(["pipeline.scoring.tasks:add"]), ToolLimits()) as ex:
        env = ToolEnvironment(executor=ex, tool_format=FORMATS["qwen3"])
        prompt = Prompt(index=0, prompt_ids=encode(PROMPT), label=None, text=PROMPT, origin="t")
        return asyncio.run(run_trajectory(
            Scripted([TURN1, TURN2]), env, prompt, SamplingParams(max_new_tokens=500),
            Budgets(max_turns=4, max_tokens=None, max_tool_time_s=5.0, fit_length=2000),
            rid="t", encode_text=encode, decode=decode))


def test_token_in_token_out_keeps_the_sampled_tokens_and_the_template_glue(tito, tokenizer):
    ids = tito.prompt_ids + tito.output_ids
    model = [t for t, m in zip(tito.output_ids, tito.output_mask) if m]
    assert model == encode(TURN1) + encode(TURN2) and tito.end_reason == "done"
    # the appended glue is what the template renders for a tool message + generation prompt
    messages = messages_of(TURN1, "42", TURN2)
    glue = decode([t for t, m in zip(tito.output_ids, tito.output_mask) if not m])
    assert glue == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert decode(ids) == PROMPT + TURN1 + glue + TURN2


def test_a_re_render_changes_the_models_own_tokens(tito, tokenizer):
    ids = tito.prompt_ids + tito.output_ids
    rendered = render(tokenizer, messages_of(TURN1, "42", TURN2))
    assert rendered != ids
    # the tool call's JSON was re-serialised: the trainer would score tokens never sampled
    assert '{"name": "add", "arguments": {"a": 12, "b": 30}}' in decode(rendered)
    assert '{"name":"add","arguments":{"a":12,"b":30}}' not in decode(rendered)
    first_diff = next(i for i, (a, b) in enumerate(zip(ids, rendered)) if a != b)
    turn1_start = len(tito.prompt_ids)
    assert turn1_start < first_diff < turn1_start + len(encode(TURN1))  # inside the model's turn
    assert len(rendered) != len(ids)  # not even the same number of tokens (slime #2263)


def test_a_later_user_turn_drops_the_earlier_think_and_breaks_the_prefix(tito, tokenizer):
    """The history of the next round: Qwen3's template keeps <think> only after the last query."""
    ids = tito.prompt_ids + tito.output_ids
    history = messages_of(TURN1, "42", TURN2) + [{"role": "user", "content": "And 1+1?"}]
    rendered = render(tokenizer, history, add_generation_prompt=True)
    assert "I need the sum." not in decode(rendered)  # the first turn's reasoning is gone
    assert "The tool says 42." not in decode(rendered)
    assert rendered[:len(ids)] != ids  # the trajectory is no longer a prefix of its history
    # token in / token out, the next round's prompt extends the trajectory exactly
    nxt = ids + encode("\n<|im_start|>user\nAnd 1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert nxt[:len(ids)] == ids and decode(nxt).startswith(PROMPT + TURN1)
