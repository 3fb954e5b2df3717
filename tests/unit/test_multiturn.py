"""Multi-turn rollouts without a server: the tool-call parser, the environment, budgets and end
reasons (``pipeline.generation.multiturn.run_trajectory`` against a scripted sender), the routes of a
trajectory, and the loss over its model tokens only - ``s_i``, the loss and its gradient of a
batch with masked tool outputs against a float64 loop over each trajectory's model tokens.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_multiturn.py``
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import threading
import time

import pytest
import torch

from megatron_gspo.loss.gspo import gspo_loss
from megatron_gspo.train.batching import rl_batch
from pipeline.scoring.data import Prompt
from pipeline.generation.environment import EnvStep, ToolEnvironment
from pipeline.generation.multiturn import Budgets, compose_routes, run_trajectory, trajectory_metrics
from pipeline.generation.client import SamplingParams
from pipeline.generation.trajectory import RolloutResult, Span, Turn
from pipeline.tools.sandbox import ToolExecutor, ToolLimits, ToolsInterrupted, load_tools
from pipeline.scoring.tasks import decode, encode
from pipeline.generation.tool_calls import FORMATS, parse_tool_calls

EOS = ord("\n")


# ------------------------------------------------------------------------------------------------
# The parser


def test_parser_reads_one_call_several_calls_and_string_arguments():
    p = parse_tool_calls('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert len(p) == 1 and p.errors == [None]
    assert (p.calls[0].name, p.calls[0].arguments) == ("add", {"a": 1, "b": 2})
    p = parse_tool_calls('<tool_call>\n{"name":"a","arguments":{}}\n</tool_call>x'
                         '<tool_call>{"name":"b","arguments":"{\\"k\\": [1]}"}</tool_call>')
    assert [c.name for c in p.calls] == ["a", "b"] and p.calls[1].arguments == {"k": [1]}
    assert len(parse_tool_calls("no call here")) == 0
    assert parse_tool_calls('<tool_call>{"name":"a"}</tool_call>').calls[0].arguments == {}


@pytest.mark.parametrize("text,says", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'needs a "name" string'),
    ('<tool_call>["add"]</tool_call>', 'needs a "name" string'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "add", "arguments": "1, 2"}</tool_call>', '"arguments" must be a JSON object'),
    ('<tool_call>{"name": "add", "arguments": {}}', "was not closed"),
])
def test_a_malformed_call_is_an_error_text_that_shows_the_format(text, says):
    p = parse_tool_calls(text)
    assert len(p) == 1 and p.calls == [None]
    assert says in p.errors[0] and p.errors[0].startswith("error: ")
    assert '<tool_call>{"name": <tool name>, "arguments":' in p.errors[0]


DEEP = "[" * 1000 + "]" * 1000
HUGE = "9" * 5000


@pytest.mark.parametrize("body,says", [
    ('{"name": "add", "arguments": {"a": %s}}' % DEEP, "nested more than 64 levels deep"),
    (DEEP, "nested more than 64 levels deep"),
    ('{"name": "add", "arguments": {"a": %s}}' % ("[" * 100 + "]" * 100),
     "nested more than 64 levels deep"),
    ('{"name": "add", "arguments": {"a": %s, "b": 1}}' % HUGE, "not valid JSON (Exceeds the limit"),
    ('{"name": "add", "arguments": %s}' % json.dumps('{"a": %s}' % HUGE),
     '"arguments" must be a JSON object (it is not valid JSON (Exceeds the limit'),
    ('{"name": "add", "arguments": %s}' % json.dumps(DEEP),
     '"arguments" must be a JSON object (it is nested more than 64 levels deep'),
])
def test_hostile_model_text_is_a_malformed_call_never_an_exception(executor, body, says):
    """Issue 38, item 11: a call nested ~1000 levels deep or holding an integer of more than 4300
    digits raised RecursionError / ValueError out of ToolEnvironment.step and ended the run."""
    p = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert p.calls == [None] and says in p.errors[0], p.errors[0][:300]
    env = ToolEnvironment(executor=executor, tool_format=FORMATS["plain"])
    step = env.step(f"<tool_call>{body}</tool_call>", tool_time_left_s=10)
    assert step.errors == ["malformed"] and not step.done and says in step.observation


def test_a_good_call_next_to_a_malformed_one_is_kept_in_order():
    p = parse_tool_calls('<tool_call>{"name":"x"</tool_call><tool_call>{"name":"y"}</tool_call>')
    assert p.calls[0] is None and p.calls[1].name == "y" and p.errors[1] is None


def test_formats_render_qwen3s_tool_turn_and_the_plain_one():
    assert FORMATS["qwen3"].render(["3", "4"]) == (
        "\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert FORMATS["plain"].render(["3"]) == "<tool_response>3</tool_response>"


# ------------------------------------------------------------------------------------------------
# Trajectories against a scripted sender


class Scripted:
    """``send`` of a server that answers each turn of a rid with the next scripted text."""

    def __init__(self, turns: list[str], *, finish: dict | None = None, url: str = "http://s0"):
        self.turns, self.finish, self.url = turns, finish or {}, url
        self.requests: list[tuple[str, list[int], SamplingParams, str | None]] = []

    async def __call__(self, rid, input_ids, sampling, *, routed_experts=None, pin=None):
        k = len(self.requests)
        self.requests.append((rid, list(input_ids), sampling, pin))
        ids = encode(self.turns[k])[:sampling.max_new_tokens]
        finish = self.finish.get(k, "stop" if ids and ids[-1] == EOS else "length")
        lps = [-0.1 * (k + 1) - 0.01 * j for j in range(len(ids))]
        routes = None
        if routed_experts is not None:  # every row: expert k (the turn) in every layer
            n = len(input_ids) + len(ids) - 1
            routes = torch.full((n, *routed_experts), k, dtype=torch.int32)
        return RolloutResult(
            rid=rid, prompt_ids=list(input_ids), output_ids=ids, output_logprobs=lps,
            finish_reason=finish, matched_stop=EOS if finish == "stop" else None,
            prompt_tokens=len(input_ids), completion_tokens=len(ids), weight_version=k,
            server_url=self.url, weight_versions=[Span(k, 0, len(ids))] if ids else [],
            routed_experts=routes, cached_tokens=len(input_ids) - 1 if k else 0)


@pytest.fixture(scope="module")
def executor():
    tools = load_tools(["pipeline.scoring.tasks:add", "tests.unit.sandbox_tools:hang"])
    with ToolExecutor(tools, ToolLimits(timeout_s=2.0), workers=2) as ex:
        yield ex


def run(send, executor, prompt="12+30=", *, max_turns=4, max_tokens=None, tool_s=10.0,
        fit=None, routed=None):
    env = ToolEnvironment(executor=executor, tool_format=FORMATS["plain"])
    budgets = Budgets(max_turns=max_turns, max_tokens=max_tokens, max_tool_time_s=tool_s,
                      fit_length=fit)
    p = Prompt(index=0, prompt_ids=encode(prompt), label=None, text=prompt, origin="t")
    return asyncio.run(run_trajectory(send, env, p, SamplingParams(max_new_tokens=200), budgets,
                                      rid="r", encode_text=encode, decode=decode,
                                      routed_experts=routed, pin="http://s0"))


CALL = '<tool_call>{"name":"add","arguments":{"a":12,"b":30}}</tool_call>\n'


def test_a_call_then_an_answer_is_done_with_the_tool_output_appended_and_masked(executor):
    send = Scripted([CALL, "42\n"])
    r = run(send, executor, max_tokens=500)
    obs = encode("<tool_response>42</tool_response>")
    assert r.output_ids == encode(CALL) + obs + encode("42\n")
    assert r.output_mask == [1] * len(CALL) + [0] * len(obs) + [1] * 3
    assert r.end_reason == "done" and len(r.turns) == 2
    assert r.turns[0].tool_calls == 1 and r.turns[0].tool_errors == 0
    assert r.turns[0].observation_length == len(obs) and r.turns[1].start == len(CALL) + len(obs)
    # token in / token out: turn 2's request is the prompt, turn 1's ids, the appended ids
    assert send.requests[1][1] == encode("12+30=") + encode(CALL) + obs
    assert [q[3] for q in send.requests] == ["http://s0"] * 2  # the same server
    # the log-probs are the server's on its tokens, 0 on the appended ones
    assert r.output_logprobs[:len(CALL)] == send_lps(0, len(CALL))
    assert r.output_logprobs[len(CALL):len(CALL) + len(obs)] == [0.0] * len(obs)
    # the weight-version spans cover the model's turns at their offsets in the output
    assert r.weight_versions == [(0, 0, len(CALL)), (1, len(CALL) + len(obs), len(r.output_ids))]
    assert r.completion_tokens == len(CALL) + 3 and r.cached_tokens == len(encode("12+30=") + encode(CALL) + obs) - 1


def send_lps(k, n):
    return [-0.1 * (k + 1) - 0.01 * j for j in range(n)]


def test_a_malformed_call_is_answered_with_the_error_and_the_trajectory_goes_on(executor):
    send = Scripted(['<tool_call>{"name":"add","arguments":{"a":1,}}</tool_call>\n', CALL, "42\n"])
    r = run(send, executor, max_tokens=800)
    assert r.end_reason == "done" and len(r.turns) == 3
    assert r.turns[0].tool_errors == 1 and r.turns[0].errors == ("malformed",)
    text = decode(send.requests[1][1])
    assert "<tool_response>error: the tool call is not valid JSON" in text


def test_max_turns_ends_without_appending_the_last_answer(executor):
    r = run(Scripted([CALL] * 3), executor, max_turns=2, max_tokens=800)
    assert r.end_reason == "max_turns" and len(r.turns) == 2
    assert r.output_mask[-1] == 1 and r.turns[-1].observation_length == 0
    assert len(r.output_ids) == 2 * len(CALL) + len(encode("<tool_response>42</tool_response>"))


def test_max_tokens_caps_the_turn_and_ends_the_trajectory(executor):
    send = Scripted([CALL, "42\n"])
    r = run(send, executor, max_tokens=len(CALL) + 10)
    # the answer does not fit with a turn after it: ends after the first turn
    assert r.end_reason == "max_tokens" and len(r.output_ids) == len(CALL)
    r = run(Scripted([CALL]), executor, max_tokens=20)  # the first turn is cut at 20
    assert r.end_reason == "max_tokens" and len(r.output_ids) == 20 and r.finish_reason == "length"
    r = run(Scripted([CALL]), executor, fit=len("12+30=") + 25)  # the training row's room
    assert r.end_reason == "max_tokens" and len(r.output_ids) == 25


def test_tool_time_runs_out_then_tool_error(executor):
    hang = '<tool_call>{"name":"hang","arguments":{"seconds":30}}</tool_call>\n'
    r = run(Scripted([hang, "x\n"]), executor, tool_s=0.4, max_tokens=800)
    assert r.end_reason == "tool_error" and len(r.turns) == 1
    assert r.turns[0].errors == ("timeout",) and 0.35 < r.turns[0].tool_seconds < 2.0


def test_an_aborted_turn_ends_with_abort(executor):
    r = run(Scripted([CALL, "4"], finish={1: "abort"}), executor, max_tokens=800)
    assert r.end_reason == "abort" and r.finish_reason == "abort" and len(r.turns) == 2


def test_trajectory_metrics_count_turns_calls_end_reasons_and_tokens(executor):
    a = run(Scripted([CALL, "42\n"]), executor, max_tokens=800)
    b = run(Scripted([CALL] * 3), executor, max_turns=2, max_tokens=800)
    m = trajectory_metrics([a, b])
    assert m["num_turns/mean"] == 2 and m["tool_calls/mean"] == 1.5
    assert m["end_reason/done"] == 0.5 and m["end_reason/max_turns"] == 0.5
    assert m["trained_tokens"] == sum(a.output_mask) + sum(b.output_mask)
    assert m["masked_tokens"] == a.output_mask.count(0) + b.output_mask.count(0)
    assert m["cached_tokens_per_turn"] > 0
    assert m["tool_errors/timeout"] == m["tool_errors/malformed"] == 0.0


def test_failed_calls_are_counted_by_reason(executor):
    bad = '<tool_call>{"name":"add","arguments":{"a":1,}}</tool_call>\n'
    hang = '<tool_call>{"name":"hang","arguments":{"seconds":30}}</tool_call>\n'
    a = run(Scripted([bad, CALL, "42\n"]), executor, max_tokens=800)
    b = run(Scripted([hang, "x\n"]), executor, tool_s=0.3, max_tokens=800)
    m = trajectory_metrics([a, b])
    assert m["tool_errors/malformed"] == m["tool_errors/timeout"] == 0.5
    assert m["tool_errors/mean"] == 1.0 and m["end_reason/tool_error"] == 0.5


class SurrogateEnv:
    """A custom environment whose answer is not valid UTF-8 text (a lone surrogate)."""

    def reset(self, prompt):
        return list(prompt.prompt_ids)

    def step(self, text, *, tool_time_left_s):
        return EnvStep(observation="<tool_response>caf\udcc3</tool_response>")


def test_an_environment_answer_that_is_not_utf8_is_sanitised_and_counted():
    """Issue 38, item 5: the answer reached the tokenizer and raised UnicodeEncodeError."""
    p = Prompt(index=0, prompt_ids=encode("1+1="), label=None, text="1+1=", origin="t")
    r = asyncio.run(run_trajectory(Scripted(["call\n", "2\n"]), SurrogateEnv(), p,
                                   SamplingParams(max_new_tokens=50),
                                   Budgets(max_turns=2, max_tokens=500, max_tool_time_s=5),
                                   rid="r", encode_text=encode, decode=decode))
    assert r.turns[0].errors == ("encoding",) and r.turns[0].tool_errors == 1
    assert "caf\ufffd" in decode(r.output_ids)
    assert trajectory_metrics([r])["tool_errors/encoding"] == 1.0


@pytest.mark.parametrize("trajectories", [6])
def test_a_stop_signal_ends_a_rollout_of_slow_tools_within_one_tool_timeout(trajectories):
    """Issue 38, item 12: a stop during slow tool calls took 325 s with tools.timeout_s 20 (every
    call ran to its timeout, one after the other). Here 6 trajectories of 4 turns, each calling a
    tool that sleeps past its 2 s timeout, on 1 worker: 48 s without a stop; after the stop flag
    the rollout raises within one tool timeout."""
    stop = threading.Event()
    tools = load_tools(["tests.unit.sandbox_tools:hang"])
    hang = '<tool_call>{"name":"hang","arguments":{}}</tool_call>\n'
    with ToolExecutor(tools, ToolLimits(timeout_s=2.0), workers=1, interrupted=stop.is_set) as ex:
        env = ToolEnvironment(executor=ex, tool_format=FORMATS["plain"])
        p = Prompt(index=0, prompt_ids=encode("1+1="), label=None, text="1+1=", origin="t")
        budgets = Budgets(max_turns=4, max_tokens=2000, max_tool_time_s=60)

        async def rollout():
            return await asyncio.gather(*[
                run_trajectory(Scripted([hang] * 4), env, p, SamplingParams(max_new_tokens=100),
                               budgets, rid=f"r{i}", encode_text=encode, decode=decode)
                for i in range(trajectories)])
        threading.Timer(1.0, stop.set).start()  # the stop signal, during the first calls
        t0 = time.monotonic()
        with pytest.raises(ToolsInterrupted, match="a stop signal came"):
            asyncio.run(rollout())  # returns once every tool thread is done
        assert time.monotonic() - t0 < 1.0 + 2.0, "not within one tool timeout of the stop"


def test_routes_come_from_the_turn_that_first_computed_each_token(executor):
    r = run(Scripted([CALL, "42\n"]), executor, max_tokens=800, routed=(2, 1))
    n1 = len("12+30=") + len(CALL) - 1  # rows turn 1 returned: prompt + its output - 1
    rows = r.routed_experts
    assert rows.shape == (len(r.prompt_ids) + len(r.output_ids) - 1, 2, 1)
    assert rows[:n1, 0, 0].tolist() == [0] * n1  # first computed by turn 1
    assert rows[n1:, 0, 0].tolist() == [1] * (rows.shape[0] - n1)  # by turn 2's prefill/decode
    assert compose_routes([rows[:3], None]) is None


# ------------------------------------------------------------------------------------------------
# The loss over the model's tokens


def _trajectories(seed: int) -> list[RolloutResult]:
    """Trajectories of 1-3 model turns with appended answers, of different lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(6):
        ids, lps, mask, turns = [], [], [], []
        for k in range(rng.randint(1, 3)):
            n = rng.randint(1, 7)
            turns.append(Turn(start=len(ids), length=n, observation_length=0,
                              finish_reason="stop", cached_tokens=0, prompt_tokens=0,
                              server_url=""))
            ids += [rng.randint(32, 120) for _ in range(n)]
            lps += [-rng.random() * 3 for _ in range(n)]
            mask += [1] * n
            if k < 2 and rng.random() < 0.8:
                m = rng.randint(1, 6)
                ids += [rng.randint(32, 120) for _ in range(m)]
                lps += [0.0] * m
                mask += [0] * m
        prompt = [rng.randint(32, 120) for _ in range(rng.randint(2, 5))]
        out.append(RolloutResult(rid=f"t{i}", prompt_ids=prompt, output_ids=ids,
                                 output_logprobs=lps, finish_reason="stop", matched_stop=None,
                                 prompt_tokens=len(prompt), completion_tokens=sum(mask),
                                 weight_version=0, server_url="", output_mask=mask,
                                 turns=turns))
    return out


@pytest.mark.parametrize("variant", ["gspo", "gspo_token", "grpo"])
def test_s_i_and_the_loss_cover_the_model_tokens_only(variant):
    trajs = _trajectories(3)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, -0.9])
    seq = 40
    batch = rl_batch([t.prompt_ids for t in trajs], [t.output_ids for t in trajs],
                     [t.output_logprobs for t in trajs], adv, seq, 0,
                     output_masks=[t.output_mask for t in trajs])
    mask = batch["response_mask"]
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(len(trajs), seq, generator=gen, dtype=torch.float64) * 3
    lp = (old + 0.3 * torch.randn(len(trajs), seq, generator=gen, dtype=torch.float64)
          ).requires_grad_()
    eps_low, eps_high = 0.2, 0.25
    loss, metrics = gspo_loss(lp, old, adv.double(), mask, eps_low=eps_low, eps_high=eps_high,
                              variant=variant)
    loss.backward()

    # the reference: each trajectory's model tokens found from its turn records (not the mask):
    # output token j of a turn sits at label position len(prompt) - 1 + j
    total, grad = 0.0, torch.zeros_like(lp, dtype=torch.float64)
    log_s = []
    for i, t in enumerate(trajs):
        pos = [len(t.prompt_ids) - 1 + turn.start + j for turn in t.turns
               for j in range(turn.length)]
        assert mask[i].nonzero()[:, 0].tolist() == pos  # the mask is exactly those positions
        assert batch["rollout_log_probs"][i, pos].tolist() == pytest.approx(
            [t.output_logprobs[p - len(t.prompt_ids) + 1] for p in pos])
        x = [float(lp.detach()[i, p] - old[i, p]) for p in pos]
        n, a = len(pos), float(adv[i])
        s = math.exp(sum(x) / n)
        log_s.append(sum(x) / n)
        if variant == "grpo":
            j_terms = []
            for p, xt in zip(pos, x):
                w = math.exp(xt)
                unclipped = w * a <= min(max(w, 1 - eps_low), 1 + eps_high) * a
                j_terms.append(min(w * a, min(max(w, 1 - eps_low), 1 + eps_high) * a))
                grad[i, p] = -(w * a / n if unclipped else 0.0) / len(trajs)
            total += sum(j_terms) / n
        else:
            clipped = min(max(s, 1 - eps_low), 1 + eps_high)
            unclipped = s * a <= clipped * a
            total += min(s * a, clipped * a)
            for p in pos:
                grad[i, p] = -(s * a / n if unclipped else 0.0) / len(trajs)
    assert float(loss.detach()) == pytest.approx(-total / len(trajs), rel=1e-12, abs=1e-12)
    assert torch.allclose(lp.grad, grad, rtol=1e-10, atol=1e-13)
    assert metrics["log_ratio_seq_mean"] == pytest.approx(sum(log_s) / len(log_s), rel=1e-9)
    assert metrics["log_ratio_seq_max"] == pytest.approx(max(log_s), rel=1e-9)
    assert metrics["response_length_max"] == max(sum(t.output_mask) for t in trajs)


def test_the_batch_refuses_a_mask_of_the_wrong_length_or_without_model_tokens():
    adv = torch.zeros(1)
    with pytest.raises(ValueError, match="output mask must be 3 values"):
        rl_batch([[1, 2]], [[3, 4, 5]], [[0.0] * 3], adv, 8, 0, output_masks=[[1, 0]])
    with pytest.raises(ValueError, match="at least one 1"):
        rl_batch([[1, 2]], [[3, 4, 5]], [[0.0] * 3], adv, 8, 0, output_masks=[[0, 0, 0]])
    # a trajectory whose first turn was aborted before its first token: no response tokens
    batch = rl_batch([[1, 2], [1, 2]], [[], [3, 4]], [[], [-1.0, 0.0]], torch.zeros(2), 8, 0,
                     output_masks=[[], [1, 0]])
    assert batch["response_mask"].sum(1).tolist() == [0, 1]


# ------------------------------------------------------------------------------------------------
# Configuration


class NotAnEnvironment:
    def reset(self, prompt):
        return []


@pytest.mark.parametrize("section,said", [
    ({"functions": ["pipeline.scoring.tasks"]}, "tools.functions[0]: expected"),
    ({"functions": ["pipeline.scoring.tasks:add"], "max_turns": 0}, "tools.max_turns: must be >= 1"),
    ({"functions": ["pipeline.scoring.tasks:add"], "timeout_s": 0}, "tools.timeout_s: must be > 0"),
    ({"functions": ["pipeline.scoring.tasks:add"], "workers": 0}, "tools.workers: must be >= 1"),
    ({"functions": ["pipeline.scoring.tasks:add"], "format": "xml"}, "tools.format"),
    ({"environment": "NoColon"}, "tools.environment: expected"),
    ({"functions": ["pipeline.scoring.tasks:add"], "isolation": "none"}, "tools.isolation"),
    ({"functions": ["pipeline.scoring.tasks:add"], "pass_env": ["A=B"]},
     "tools.pass_env[0]: expected the name of an environment variable"),
])
def test_bad_tools_settings_name_the_field(section, said):
    from megatron_gspo.config import ConfigError, config_from_dict

    with pytest.raises((ConfigError, ValueError), match=re.escape(said)):
        config_from_dict({"tools": section})


@pytest.mark.parametrize("section,said", [
    ({"functions": ["pipeline.scoring.tasks:add", "pipeline.scoring.tasks:nope"]},
     "tools.functions[1]: 'pipeline.scoring.tasks:nope': module pipeline.scoring.tasks has no attribute 'nope'"),
    ({"environment": "tests.unit.test_multiturn:NotAnEnvironment"},
     "tools.environment 'tests.unit.test_multiturn:NotAnEnvironment': not an environment class"),
    ({"environment": "nowhere.env:Env"}, "tools.environment: 'nowhere.env:Env': no module"),
])
def test_preflight_imports_the_tools_and_the_environment(section, said):
    from launch.preflight import check
    from megatron_gspo.config import ConfigError, config_from_dict

    cfg = config_from_dict({"tools": section})
    with pytest.raises(ConfigError, match=re.escape(said)):
        check(cfg, program="config", world_size=None, notes=[])


def test_the_demo_config_passes_preflight():
    from launch.preflight import check
    from megatron_gspo.config import load_config

    cfg = load_config("launch/configs/tiny_cpu_tools.yaml")
    assert cfg.tools.enabled() and cfg.data.task == "tool_addition"
    check(cfg, program="config", world_size=2, notes=[])


# ------------------------------------------------------------------------------------------------
# The demo's task


def test_tool_addition_task_references_call_the_tool_and_the_reward_reads_the_last_turn():
    from megatron_gspo.config import DataConfig
    from pipeline.scoring.data import build_datasets
    from pipeline.scoring.rewards import tool_addition
    from pipeline.scoring.tasks import ToolAdditionTask, add

    task = ToolAdditionTask(digits=5, seed=3)
    train = {task.problem(i).prompt for i in range(300)}
    held = {task.problem(i, split="eval").prompt for i in range(100)}
    assert not train & held
    p = task.problem(7)
    a, b = map(int, p.prompt[:-1].split("+"))
    assert 10**4 <= a < 10**5 and 10**4 <= b < 10**5
    call, _, rest = p.answer.partition("\n")
    parsed = parse_tool_calls(call).calls[0]
    assert (parsed.name, parsed.arguments) == ("add", {"a": a, "b": b})
    assert add(**parsed.arguments) == a + b
    assert rest == FORMATS["plain"].render([str(a + b)]) + str(a + b)
    assert len(p.prompt) + len(p.answer) + 1 <= task.max_length() == 128
    prompt = Prompt(index=7, prompt_ids=encode(p.prompt), label=p.answer, text=p.prompt, origin="t")
    assert tool_addition(prompt, encode(f"{a + b}\n"), "") == 1.0
    assert tool_addition(prompt, encode(f"{a + b + 1}\n"), "") == 0.0
    assert tool_addition(prompt, encode(call + "\n"), "") == 0.0  # a call is not an answer
    train_set, eval_set = build_datasets(DataConfig(task="tool_addition", digits=5,
                                                    num_eval_prompts=4), seed=3)
    assert train_set[7].label == p.answer and len(eval_set) == 4
