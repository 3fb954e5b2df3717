"""Synthetic verifiable tasks for the CPU demo and the tests (no downloads).

``AdditionTask``: "a+b=" -> "c" with exact answers, in a byte-level vocabulary (token id = byte,
end of answer = "\n"). Problems are drawn from a seeded generator, so the same (seed, index) gives
the same problem on every rank and after a resume. The reward is exact match of the answer.

``CarryAdditionTask``: the same sums written out column by column before the answer, a long
response (64-256 tokens at ``digits`` 6-22) whose only checked part is its final segment, so
that sequence length, packing and context parallelism matter (``data.task: carry_addition``).

``ToolAdditionTask``: sums of two ``digits``-digit numbers (too long for the tiny model to add
token by token) that a calculator tool solves (``data.task: tool_addition``, the multi-turn demo,
``megatron-gspo demo --task tools``): the reference response calls :func:`add` in Qwen3's
``<tool_call>`` format, reads the ``<tool_response>`` and answers with it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_ID = ord("\n")
PAD_ID = 0


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str

    @property
    def prompt_ids(self) -> list[int]:
        return encode(self.prompt)

    @property
    def answer_ids(self) -> list[int]:
        return encode(self.answer) + [EOS_ID]


@dataclass(frozen=True)
class AdditionTask:
    """Sums of two non-negative integers with up to ``digits`` digits each."""

    digits: int = 2
    seed: int = 0

    name = "addition"

    def is_held_out(self, a: int, b: int) -> bool:
        """One pair in 8 belongs to the held-out split; training never sees those pairs."""
        return random.Random(f"{self.seed}:pair:{a}:{b}").random() < 0.125

    def problem(self, index: int, *, split: str = "train") -> Problem:
        """Problem ``index`` of ``split`` ("train" or "eval"); the two splits share no pair."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.seed}:{split}:{index}")
        high = 10 ** self.digits - 1
        while True:
            a, b = rng.randint(0, high), rng.randint(0, high)
            if self.is_held_out(a, b) == (split == "eval"):
                return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    def problems(self, start: int, count: int, *, split: str = "train") -> list[Problem]:
        return [self.problem(i, split=split) for i in range(start, start + count)]

    @staticmethod
    def reward(problem: Problem, response_ids: list[int]) -> float:
        """1.0 if the response is exactly the answer (up to the end-of-answer token), else 0.0."""
        text = decode(response_ids[:response_ids.index(EOS_ID)] if EOS_ID in response_ids
                      else response_ids)
        return 1.0 if text.strip() == problem.answer else 0.0

    def max_length(self) -> int:
        """Prompt + answer + end token of the longest problem."""
        return 2 * self.digits + 2 + (self.digits + 1) + 1


@dataclass(frozen=True)
class CarryAdditionTask:
    """Multi-digit addition with a written-out digit-by-digit carry trace before the answer.

    Prompt ``"478+96="``; response (the label, what SFT trains on) one segment per column,
    least significant first, ``x+y+c=ss`` (the column's digits, the incoming carry, the two-digit
    column sum whose first digit is the next carry), then the answer, ``;``-separated, then the
    end token ``"\n"`` (which ends generation, so segments cannot be lines)::

        8+6+0=14;7+9+1=17;4+0+1=05;=574

    A problem has n columns, n uniform in ``[ceil(digits / 4), digits]`` (a 4x spread of
    lengths); the first operand has exactly n digits, the second up to n. A response is
    ``10 n + 2`` or ``10 n + 3`` tokens with the end token: 62-63 at n = 6, 242-243 at n = 24
    (``digits: 24`` spans 62-243). The reward is exact match of the FINAL segment (``=574``)
    only: the trace is the model's scratch work.
    """

    digits: int = 24
    seed: int = 0

    name = "carry_addition"

    def is_held_out(self, a: int, b: int) -> bool:
        return random.Random(f"{self.seed}:carry-pair:{a}:{b}").random() < 0.125

    def problem(self, index: int, *, split: str = "train") -> Problem:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.seed}:carry:{split}:{index}")
        while True:
            columns = rng.randint(-(-self.digits // 4), self.digits)
            a = rng.randint(10 ** (columns - 1) if columns > 1 else 0, 10 ** columns - 1)
            b = rng.randint(0, 10 ** rng.randint(1, columns) - 1)
            if self.is_held_out(a, b) == (split == "eval"):
                return Problem(prompt=f"{a}+{b}=", answer=self.response(a, b))

    def problems(self, start: int, count: int, *, split: str = "train") -> list[Problem]:
        return [self.problem(i, split=split) for i in range(start, start + count)]

    @staticmethod
    def response(a: int, b: int) -> str:
        """The reference response: the carry trace and the answer (without the end token)."""
        xs, ys = str(a)[::-1], str(b)[::-1]
        carry, segments = 0, []
        for i in range(max(len(xs), len(ys))):
            x = int(xs[i]) if i < len(xs) else 0
            y = int(ys[i]) if i < len(ys) else 0
            total = x + y + carry
            segments.append(f"{x}+{y}+{carry}={total:02d}")
            carry = total // 10
        segments.append(f"={a + b}")
        return ";".join(segments)

    @staticmethod
    def final_segment(text: str) -> str:
        return text.rsplit(";", 1)[-1].strip()

    @classmethod
    def reward(cls, problem: Problem, response_ids: list[int]) -> float:
        """1.0 if the response's final segment (up to the end token) is the answer's, else 0.0."""
        text = decode(response_ids[:response_ids.index(EOS_ID)] if EOS_ID in response_ids
                      else response_ids)
        return 1.0 if cls.final_segment(text) == cls.final_segment(problem.answer) else 0.0

    def max_length(self) -> int:
        """Prompt + response + end token of the longest problem."""
        return (2 * self.digits + 2) + (10 * self.digits + 3)


def add(a: int, b: int) -> int:
    """The calculator of ``ToolAdditionTask`` (``tools.functions: ["pipeline.scoring.tasks:add"]``)."""
    return int(a) + int(b)


TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


@dataclass(frozen=True)
class ToolAdditionTask:
    """Sums of two numbers of exactly ``digits`` digits, solved with the ``add`` tool.

    Prompt ``"48213+90517="``; the reference response (the SFT label) is a trajectory in the
    ``plain`` tool format (``pipeline.generation.tool_calls.FORMATS``): a turn that calls the tool and ends
    with the end token, the tool's response as the environment appends it, the answer::

        <tool_call>{"name":"add","arguments":{"a":48213,"b":90517}}</tool_call>\n
        <tool_response>138730</tool_response>138730

    (one line in the data; the end token follows). The reward is exact match of the last model
    turn (up to the end token) with the sum, whatever came before it: an answer without a call
    counts as much as one after a call (it is just rarely right at this length).
    """

    digits: int = 5
    seed: int = 0

    name = "tool_addition"

    def is_held_out(self, a: int, b: int) -> bool:
        return random.Random(f"{self.seed}:tool-pair:{a}:{b}").random() < 0.125

    def problem(self, index: int, *, split: str = "train") -> Problem:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        rng = random.Random(f"{self.seed}:tool:{split}:{index}")
        low, high = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10 ** self.digits - 1
        while True:
            a, b = rng.randint(low, high), rng.randint(low, high)
            if self.is_held_out(a, b) == (split == "eval"):
                return Problem(prompt=f"{a}+{b}=", answer=self.response(a, b))

    def problems(self, start: int, count: int, *, split: str = "train") -> list[Problem]:
        return [self.problem(i, split=split) for i in range(start, start + count)]

    @staticmethod
    def call(a: int, b: int) -> str:
        """The model's tool-calling turn (without its end token)."""
        return f'<tool_call>{{"name":"add","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'

    @classmethod
    def response(cls, a: int, b: int) -> str:
        """The reference trajectory (without the final end token)."""
        return (cls.call(a, b) + chr(EOS_ID) + TOOL_RESPONSE_OPEN + str(a + b)
                + TOOL_RESPONSE_CLOSE + str(a + b))

    @staticmethod
    def final_answer(text: str) -> str:
        """The answer of a response or label: what follows its last tool response."""
        return text.rsplit(TOOL_RESPONSE_CLOSE, 1)[-1].strip()

    @classmethod
    def reward(cls, problem: Problem, response_ids: list[int]) -> float:
        """1.0 if the response (a trajectory's last model turn), up to the end token, is the sum."""
        text = decode(response_ids[:response_ids.index(EOS_ID)] if EOS_ID in response_ids
                      else response_ids)
        return 1.0 if text.strip() == cls.final_answer(problem.answer) else 0.0

    def max_length(self) -> int:
        """Prompt + reference trajectory + end token of the longest problem."""
        n = self.digits
        return (2 * n + 2) + len(self.response(10 ** n - 1, 10 ** n - 1)) + 1


TASKS = {"addition": AdditionTask, "carry_addition": CarryAdditionTask,
         "tool_addition": ToolAdditionTask}
"""``data.task`` name -> task class (constructed with ``digits`` and ``seed``)."""


def write_sft_file(path, task, count: int, *, split: str = "train", start: int = 0) -> None:
    """SFT data for a task as a JSONL file of ``{"prompt", "label"}`` rows (the reference
    response as the label: the carry trace and the answer for ``CarryAdditionTask``), readable
    with ``data.train_path`` and the default ``data.prompt_key`` / ``data.label_key``."""
    with Path(path).open("w") as out:
        for problem in task.problems(start, count, split=split):
            out.write(json.dumps({"prompt": problem.prompt, "label": problem.answer}) + "\n")


def _byte_token(b: int) -> str:
    ch = chr(b)
    return ch if ch.isprintable() and b < 128 or ch == "\n" else f"<0x{b:02X}>"


def write_byte_tokenizer(directory) -> None:
    """Save a tokenizer whose ids are bytes (id 10 "\\n" ends an answer), plus a
    generation_config.json naming that end token, into a model directory.

    The rollout servers and the sglang-router read the tokenizer from the model directory; this
    one matches ``encode`` / ``decode`` above for ASCII text, so no hub download is ever needed.
    """
    from transformers import PreTrainedTokenizerFast

    vocab = {_byte_token(b): b for b in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=_byte_token(PAD_ID)))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="\n", pad_token=_byte_token(PAD_ID))
    directory = Path(directory)
    fast.save_pretrained(str(directory))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
