"""Synthetic verifiable tasks for the CPU demo and the tests (no downloads).

``AdditionTask``: "a+b=" -> "c" with exact answers, in a byte-level vocabulary (token id = byte,
end of answer = "\n"). Problems are drawn from a seeded generator, so the same (seed, index) gives
the same problem on every rank and after a resume. The reward is exact match of the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

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
