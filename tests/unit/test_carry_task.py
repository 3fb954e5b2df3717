"""The long-response task: the carry trace is right digit by digit, lengths span 62-243 tokens,
the reward reads the final segment only, the splits are disjoint, and the task is selectable
from the config (datasets, reward, SFT pairs and an SFT file)."""

from __future__ import annotations

import pytest

from megatron_gspo.config import config_from_dict
from pipeline.scoring.data import PromptDataset, build_datasets
from pipeline.scoring.rewards import build_reward
from pipeline.step.sft_loop import sft_pairs
from pipeline.scoring.tasks import EOS_ID, CarryAdditionTask, Problem, encode, write_sft_file


def _check_trace(a: int, b: int, response: str) -> None:
    """Column i: digit i of a, digit i of b, the carry into it, and their two-digit sum."""
    *columns, answer = response.split(";")
    assert answer == f"={a + b}"
    carry = 0
    for i, column in enumerate(columns):
        x, y = (a // 10 ** i) % 10, (b // 10 ** i) % 10
        assert column == f"{x}+{y}+{carry}={x + y + carry:02d}", (i, column)
        carry = (x + y + carry) // 10
    assert len(columns) == max(len(str(a)), len(str(b)))


def test_traces_are_correct_and_deterministic():
    task = CarryAdditionTask(digits=24, seed=3)
    for problem in task.problems(0, 200):
        a, b = (int(x) for x in problem.prompt[:-1].split("+"))
        _check_trace(a, b, problem.answer)
    assert task.problem(17) == CarryAdditionTask(digits=24, seed=3).problem(17)
    assert CarryAdditionTask.response(478, 96) == "8+6+0=14;7+9+1=17;4+0+1=05;=574"


def test_response_lengths_span_the_long_range():
    task = CarryAdditionTask(digits=24)
    lengths = [len(p.answer_ids) for p in task.problems(0, 1000)]
    assert 62 <= min(lengths) <= 70 and 235 <= max(lengths) <= 243
    assert max(len(p.prompt_ids) + len(p.answer_ids) for p in task.problems(0, 1000)) <= task.max_length()


def test_reward_reads_the_final_segment_only():
    problem = Problem(prompt="478+96=", answer=CarryAdditionTask.response(478, 96))
    assert CarryAdditionTask.reward(problem, problem.answer_ids) == 1.0
    # a wrong trace with the right answer still scores; the end token and what follows are cut
    assert CarryAdditionTask.reward(problem, encode("1+1+0=99;=574") + [EOS_ID] + encode("x")) == 1.0
    assert CarryAdditionTask.reward(problem, encode("8+6+0=14;7+9+1=17;4+0+1=05;=575")) == 0.0
    assert CarryAdditionTask.reward(problem, encode("574")) == 0.0
    assert CarryAdditionTask.reward(problem, []) == 0.0


def test_train_and_eval_splits_share_no_pair():
    task = CarryAdditionTask(digits=8, seed=1)
    train = {p.prompt for p in task.problems(0, 3000)}
    held_out = {p.prompt for p in task.problems(0, 300, split="eval")}
    assert not train & held_out
    with pytest.raises(ValueError, match="split"):
        task.problem(0, split="test")


def test_selected_from_the_config_with_its_reward_and_sft_pairs():
    cfg = config_from_dict({"data": {"task": "carry_addition", "digits": 24, "num_eval_prompts": 8}})
    train, held_out = build_datasets(cfg.data, seed=5)
    assert train.name == "carry_addition/train" and len(held_out) == 8
    prompt = train[0]
    reward = build_reward(cfg.reward, cfg.data)
    assert reward(prompt, encode(prompt.label) + [EOS_ID], prompt.label) == 1.0
    (pair,) = sft_pairs([prompt], train.encoder)
    assert pair == (prompt.prompt_ids, encode(prompt.label) + [EOS_ID])
    assert ";" in prompt.label  # SFT trains on the trace, not only the answer
    with pytest.raises(Exception, match="data.digits"):
        config_from_dict({"data": {"task": "carry_addition", "digits": 40}})


def test_sft_file_round_trips_through_the_prompt_reader(tmp_path):
    path = tmp_path / "carry.jsonl"
    task = CarryAdditionTask(digits=10, seed=2)
    write_sft_file(path, task, 5)
    rows = PromptDataset(path)
    assert len(rows) == 5
    assert [rows[i].label for i in range(5)] == [p.answer for p in task.problems(0, 5)]
