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


def _byte_token(b: int) -> str:
    ch = chr(b)
    return ch if ch.isprintable() and b < 128 or ch == "\n" else f"<0x{b:02X}>"


def write_byte_tokenizer(directory) -> None:
    """Save a tokenizer whose ids are bytes (id 10 "\\n" ends an answer), plus a
    generation_config.json naming that end token, into a model directory.

    The rollout servers and the sglang-router read the tokenizer from the model directory; this
    one matches ``encode`` / ``decode`` above for ASCII text, so no hub download is ever needed.
    """
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {_byte_token(b): b for b in range(256)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=_byte_token(PAD_ID)))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="\n", pad_token=_byte_token(PAD_ID))
    directory = Path(directory)
    fast.save_pretrained(str(directory))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
