"""Prompt datasets for the RL loop: prompt files or a synthetic task, behind one interface.

    train, held_out = build_datasets(cfg.data, seed=cfg.run.seed)
    sampler = PromptSampler(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    prompts = sampler.next_batch(num_prompts)          # list[Prompt], across epoch boundaries
    checkpoint["data"] = sampler.state_dict()          # resume: sampler.load_state_dict(...)

A dataset (``PromptSource``) is a finite, indexable sequence of ``Prompt`` with an ``encoder`` that
turns prompts into token ids and response ids back into text:

- ``PromptDataset``: rows of a JSONL or Parquet file, with configurable prompt / label fields
  (dotted paths reach into nested objects), encoded byte-level or by a local Hugging Face
  tokenizer, optionally through its chat template. Every row is validated when the file is
  loaded; a malformed row raises ``DataError`` naming the file, the line (JSONL) or row (Parquet,
  both 1-based) and the field. ``skip_malformed=True`` counts and reports such rows instead.
- ``TaskPromptDataset``: a synthetic task (``pipeline.scoring.tasks``) seen as a dataset: problem ``i`` of
  a split is prompt ``i``, its answer the label.

``PromptSampler`` shuffles each epoch with a permutation drawn from (seed, epoch) alone, so its
position (epoch, index) is all a checkpoint needs to continue with exactly the same prompts.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

from megatron_gspo.errors import InputError

from pipeline.scoring.tasks import EOS_ID, TASKS, AdditionTask, CarryAdditionTask
from pipeline.scoring.tasks import decode as byte_decode
from pipeline.scoring.tasks import encode as byte_encode

if TYPE_CHECKING:
    from megatron_gspo.config import DataConfig

# A synthetic task never runs out of problems; its training split is indexed 0..TASK_TRAIN_SIZE-1
# so that epochs and sampler positions mean the same as for a file.
TASK_TRAIN_SIZE = 1 << 20

Messages = list[dict[str, str]]


class DataError(ValueError, InputError):
    """A prompt file or a sampler state that cannot be used; the message says where and why."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt as the loop sees it."""

    index: int
    """Stable id: the position in its dataset (the same in every run over the same data)."""
    prompt_ids: list[int]
    """Token ids fed to the policy (chat template applied when configured)."""
    label: Optional[str]
    """Reference answer for the reward, or None."""
    text: str
    """The raw prompt as written in the data (before any chat template); for a list of chat
    messages, the content of the last user message."""
    origin: str
    """Where it came from, for error messages: "train.jsonl:17", "addition/train#5"."""


# ------------------------------------------------------------------------------------------------
# Encoders: prompt -> ids, ids -> text


class PromptEncoder(Protocol):
    eos_id: int
    """The token that ends a response."""

    def encode(self, prompt: str | Messages) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]:
        """Plain text (a response), no template and no special tokens."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteEncoder:
    """Tokenizer-free: token id = UTF-8 byte (the synthetic tasks' vocabulary), "\\n" ends."""

    eos_id = EOS_ID

    def encode(self, prompt: str | Messages) -> list[int]:
        if not isinstance(prompt, str):
            raise DataError("chat messages need a chat template: set data.tokenizer_dir")
        return byte_encode(prompt)

    def encode_text(self, text: str) -> list[int]:
        return byte_encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return byte_decode(list(ids))


class HFEncoder:
    """A local Hugging Face tokenizer, optionally through its chat template."""

    def __init__(self, tokenizer_dir: str | Path, *, apply_chat_template: bool = True):
        directory = Path(tokenizer_dir)
        if not directory.is_dir():
            raise DataError(f"data.tokenizer_dir {directory}: not a directory")
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as err:  # transformers raises OSError / ValueError / others
            raise DataError(f"data.tokenizer_dir {directory}: cannot load a tokenizer: {err}") from err
        self.apply_chat_template = apply_chat_template
        if apply_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"data.tokenizer_dir {directory}: the tokenizer has no chat template; "
                            "set data.apply_chat_template: false to encode prompts as plain text")
        if self.tokenizer.eos_token_id is None:
            raise DataError(f"data.tokenizer_dir {directory}: the tokenizer has no eos token")
        self.eos_id = int(self.tokenizer.eos_token_id)

    def encode(self, prompt: str | Messages) -> list[int]:
        if not self.apply_chat_template:
            if not isinstance(prompt, str):
                raise DataError("chat messages need the chat template: set "
                                "data.apply_chat_template: true")
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding (return_dict defaults to True), 4.x a list.
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def load_encoder(tokenizer_dir: Optional[str | Path], *,
                 apply_chat_template: bool = True) -> PromptEncoder:
    """``HFEncoder`` for a tokenizer directory, ``ByteEncoder`` for None."""
    if tokenizer_dir is None:
        return ByteEncoder()
    return HFEncoder(tokenizer_dir, apply_chat_template=apply_chat_template)


# ------------------------------------------------------------------------------------------------
# Datasets


class PromptSource(Protocol):
    """What the loop and the sampler need from a dataset."""

    name: str
    encoder: PromptEncoder

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...


_MISSING = object()


def lookup(row: Any, dotted: str) -> Any:
    """``row["a"]["b"]`` for ``"a.b"`` (a literal key "a.b" wins; digits index lists)."""
    if isinstance(row, dict) and dotted in row:
        return row[dotted]
    node = row
    for part in dotted.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_prompt(value: Any, key: str) -> tuple[str | Messages, str]:
    """The prompt (string or chat messages) and its raw text; ValueError says what is wrong."""
    where = f"field {key!r} (data.prompt_key)"
    if value is _MISSING:
        raise ValueError(f"{where} not found")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where} is an empty prompt")
        return value, value
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{where} is an empty list of messages")
        for i, message in enumerate(value):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise ValueError(f"{where}: message {i} is not {{'role': str, 'content': str}}: "
                                 f"{str(message)[:80]}")
        user = [m["content"] for m in value if m["role"] == "user"]
        text = user[-1] if user else value[-1]["content"]
        if not any(m["content"].strip() for m in value):
            raise ValueError(f"{where}: every message is empty")
        return [{"role": m["role"], "content": m["content"]} for m in value], text
    raise ValueError(f"{where}: expected a string or a list of chat messages, "
                     f"got {_type_name(value)}")


def _check_label(value: Any, key: str) -> str:
    where = f"field {key!r} (data.label_key)"
    if value is _MISSING:
        raise ValueError(f"{where} not found")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: expected a string or a number, got {_type_name(value)}")
    return value if isinstance(value, str) else str(value)


def detect_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DataError(f"{path}: cannot tell the format from the suffix {suffix!r}; "
                    "set data.format to jsonl or parquet")


def _jsonl_rows(path: Path):
    """(line number, row or exception) for each non-blank line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield lineno, ValueError(f"not UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                yield lineno, ValueError(f"invalid JSON: {err.msg} (column {err.colno})")
                continue
            if not isinstance(row, dict):
                yield lineno, ValueError(f"expected a JSON object, got {_type_name(row)}")
                continue
            yield lineno, row


def _parquet_rows(path: Path, keys: list[str]):
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(f"{path}: install pyarrow to read Parquet (pip install pyarrow)") from err
    try:
        schema = pq.read_schema(path)
        columns = [key if key in schema.names else key.split(".")[0] for key in keys]
        missing = [key for key, column in zip(keys, columns) if column not in schema.names]
        if missing:
            raise DataError(f"{path}: no column for field {missing[0]!r} "
                            f"(columns: {', '.join(schema.names)})")
        table = pq.read_table(path, columns=sorted(set(columns)))
    except DataError:
        raise
    except Exception as err:  # pyarrow raises ArrowInvalid / OSError for a damaged file
        raise DataError(f"{path}: cannot read Parquet: {err}") from err
    for rowno, row in enumerate(table.to_pylist(), start=1):
        yield rowno, row


class PromptDataset:
    """Prompts from a JSONL or Parquet file, validated when loaded, encoded when read."""

    def __init__(self, path: str | Path, *, encoder: Optional[PromptEncoder] = None,
                 prompt_key: str = "prompt", label_key: Optional[str] = "label",
                 fmt: str = "auto", limit: Optional[int] = None, skip_malformed: bool = False,
                 report=sys.stderr):
        """``limit``: keep the first ``limit`` rows. ``report``: where skipped rows are reported."""
        self.path = Path(path)
        self.name = str(self.path)
        self.encoder = encoder if encoder is not None else ByteEncoder()
        self.prompt_key, self.label_key = prompt_key, label_key
        if not self.path.is_file():
            raise DataError(f"{self.path}: prompt file not found")
        self.format = detect_format(self.path, fmt)
        unit = "line" if self.format == "jsonl" else "row"
        keys = [prompt_key] + ([label_key] if label_key else [])
        rows = (_jsonl_rows(self.path) if self.format == "jsonl"
                else _parquet_rows(self.path, keys))
        self._rows: list[tuple[str | Messages, str, Optional[str], int]] = []
        self.malformed: list[str] = []
        """Messages of the rows skipped with skip_malformed (empty otherwise)."""
        for number, row in rows:
            if limit is not None and len(self._rows) >= limit:
                break
            try:
                if isinstance(row, Exception):
                    raise row
                prompt, text = _check_prompt(lookup(row, prompt_key), prompt_key)
                label = _check_label(lookup(row, label_key), label_key) if label_key else None
            except ValueError as err:
                message = f"{self.path}:{number}: {err}" if unit == "line" else \
                    f"{self.path}: row {number}: {err}"
                if not skip_malformed:
                    raise DataError(message + " (data.skip_malformed: true skips such rows)") \
                        from None
                self.malformed.append(message)
                continue
            self._rows.append((prompt, text, label, number))
        if self.malformed:
            print(f"{self.path}: skipped {len(self.malformed)} malformed {unit}s "
                  f"(data.skip_malformed); first: {self.malformed[0]}", file=report, flush=True)
        if not self._rows:
            raise DataError(f"{self.path}: no usable prompts"
                            + (f" ({len(self.malformed)} malformed {unit}s)" if self.malformed
                               else " (empty file)"))

    @property
    def num_malformed(self) -> int:
        return len(self.malformed)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> Prompt:
        if not 0 <= index < len(self._rows):
            raise IndexError(f"{self.path}: prompt {index} out of range [0, {len(self._rows)})")
        prompt, text, label, number = self._rows[index]
        where = f"{self.path.name}:{number}" if self.format == "jsonl" else \
            f"{self.path.name}#row{number}"
        try:
            ids = self.encoder.encode(prompt)
        except DataError as err:
            raise DataError(f"{self.path}:{number}: {err}") from None
        return Prompt(index=index, prompt_ids=ids, label=label, text=text, origin=where)


class TaskPromptDataset:
    """A synthetic task's split as a dataset: prompt ``i`` is ``task.problem(i, split=split)``."""

    def __init__(self, task: AdditionTask | CarryAdditionTask, *, split: str = "train",
                 size: int = TASK_TRAIN_SIZE):
        if size < 1:
            raise DataError(f"{split} split of the synthetic task: size must be >= 1, got {size}")
        self.task, self.split, self.size = task, split, size
        self.name = f"{task.name}/{split}"
        self.encoder: PromptEncoder = ByteEncoder()

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name}: prompt {index} out of range [0, {self.size})")
        problem = self.task.problem(index, split=self.split)
        return Prompt(index=index, prompt_ids=problem.prompt_ids, label=problem.answer,
                      text=problem.prompt, origin=f"{self.name}#{index}")


def build_datasets(data: "DataConfig", *, seed: int) -> tuple[PromptSource, Optional[PromptSource]]:
    """(training prompts, held-out prompts or None) for the ``data:`` section of a config."""
    if data.task is not None:
        task = TASKS[data.task](digits=data.digits, seed=seed)
        return (TaskPromptDataset(task, split="train"),
                TaskPromptDataset(task, split="eval", size=data.num_eval_prompts))
    encoder = load_encoder(data.tokenizer_dir, apply_chat_template=data.apply_chat_template)
    common = dict(encoder=encoder, prompt_key=data.prompt_key, label_key=data.label_key,
                  fmt=data.format, skip_malformed=data.skip_malformed)
    train = PromptDataset(data.train_path, **common)
    held_out = (PromptDataset(data.eval_path, limit=data.num_eval_prompts, **common)
                if data.eval_path is not None else None)
    return train, held_out


# ------------------------------------------------------------------------------------------------
# Sampling


def _epoch_seed(seed: int, epoch: int) -> int:
    digest = hashlib.sha256(f"prompt-order:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PromptSampler:
    """Batches of prompts in a per-epoch order that depends on (seed, epoch) only.

    The position is (epoch, index into that epoch's order); ``next_batch`` crosses epoch
    boundaries, so a batch may end one epoch and start the next. Restoring ``state_dict()`` into
    a sampler over the same dataset with the same seed yields exactly the prompts the original
    would have produced next.
    """

    def __init__(self, dataset: PromptSource, *, seed: int, shuffle: bool = True):
        if len(dataset) < 1:
            raise DataError(f"{dataset.name}: no prompts to sample")
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order_epoch: Optional[int] = None
        self._order = None

    def _order_for(self, epoch: int):
        if self._order_epoch != epoch:
            import torch

            if self.shuffle:
                generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                self._order = torch.randperm(len(self.dataset), generator=generator).tolist()
            else:
                self._order = range(len(self.dataset))
            self._order_epoch = epoch
        return self._order

    def next_batch(self, n: int) -> list[Prompt]:
        if n < 0:
            raise ValueError(f"next_batch: n must be >= 0, got {n}")
        batch = []
        while len(batch) < n:
            order = self._order_for(self.epoch)
            take = min(n - len(batch), len(order) - self.index)
            batch.extend(self.dataset[i] for i in order[self.index:self.index + take])
            self.index += take
            if self.index == len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.dataset),
                "dataset": self.dataset.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the data and the seed must be the ones it was saved with."""
        for key in ("epoch", "index", "seed", "shuffle", "num_prompts"):
            if key not in state:
                raise DataError(f"sampler state: missing {key!r} (keys: {sorted(state)})")
        mismatches = [f"{key} {state[key]!r} != {value!r}"
                      for key, value in (("seed", self.seed), ("shuffle", self.shuffle),
                                         ("num_prompts", len(self.dataset)))
                      if state[key] != value]
        if mismatches:
            raise DataError(f"sampler state of {state.get('dataset', '?')} does not match "
                            f"{self.dataset.name}: {'; '.join(mismatches)} (the saved position "
                            "would select different prompts)")
        if not (isinstance(state["epoch"], int) and state["epoch"] >= 0
                and isinstance(state["index"], int) and 0 <= state["index"] < len(self.dataset)):
            raise DataError(f"sampler state: invalid position epoch {state['epoch']!r}, "
                            f"index {state['index']!r} for {len(self.dataset)} prompts")
        self.epoch, self.index = state["epoch"], state["index"]
