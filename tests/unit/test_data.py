"""Prompt datasets and the sampler: files and the synthetic task behind one interface, clear
errors for malformed rows, deterministic per-epoch shuffling, and exact resumption."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from megatron_gspo.config import config_from_dict
from pipeline.scoring.data import (ByteEncoder, DataError, HFEncoder, Prompt, PromptDataset,
                           PromptSampler, TaskPromptDataset, build_datasets, lookup)
from pipeline.scoring.tasks import AdditionTask, encode


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_rows_become_prompts_with_dotted_keys(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [
        {"q": {"text": "1+1="}, "meta": {"answer": 2}},
        "   ",  # blank lines are not rows
        {"q": {"text": "What is 3/6?"}, "meta": {"answer": "1/2"}},
    ])
    data = PromptDataset(path, prompt_key="q.text", label_key="meta.answer")
    assert len(data) == 2
    first, second = data[0], data[1]
    assert (first.index, first.text, first.label, first.prompt_ids) == (0, "1+1=", "2", encode("1+1="))
    assert second.label == "1/2" and second.origin == "train.jsonl:3"
    assert lookup({"a.b": 1, "a": {"b": 2}}, "a.b") == 1  # a literal dotted key wins
    assert lookup({"m": [{"c": "x"}]}, "m.0.c") == "x"
    unlabeled = PromptDataset(path, prompt_key="q.text", label_key=None)
    assert unlabeled[0].label is None


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "1+1=", "label": "2"', r"train\.jsonl:2: invalid JSON"),
    ('{"label": "2"}', r"train\.jsonl:2: field 'prompt' \(data\.prompt_key\) not found"),
    ('{"prompt": 5, "label": "2"}', r"train\.jsonl:2: field 'prompt' .*got int"),
    ('{"prompt": "  ", "label": "2"}', r"train\.jsonl:2: field 'prompt' .* empty prompt"),
    ('{"prompt": [], "label": "2"}', r"train\.jsonl:2: field 'prompt' .* empty list"),
    ('{"prompt": [{"role": "user"}], "label": "2"}', r"train\.jsonl:2: .*message 0 is not"),
    ('{"prompt": "x", "label": {"v": 1}}', r"train\.jsonl:2: field 'label' \(data\.label_key\): "
                                           r"expected a string or a number, got dict"),
    ('{"prompt": "x"}', r"train\.jsonl:2: field 'label' \(data\.label_key\) not found"),
    ('{"prompt": "x", "label": null}', r"got null"),
    ('[1, 2]', r"train\.jsonl:2: expected a JSON object, got list"),
])
def test_a_malformed_row_names_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "1+1=", "label": "2"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        PromptDataset(path)


def test_non_utf8_line_and_bad_files(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b'{"prompt": "a", "label": "b"}\n{"prompt": "\xff", "label": "b"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:2: not UTF-8"):
        PromptDataset(path)
    with pytest.raises(DataError, match="prompt file not found"):
        PromptDataset(tmp_path / "missing.jsonl")
    (tmp_path / "p.csv").write_text("prompt,label\n")
    with pytest.raises(DataError, match=r"p\.csv: cannot tell the format .* data\.format"):
        PromptDataset(tmp_path / "p.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: no usable prompts \(empty file\)"):
        PromptDataset(tmp_path / "empty.jsonl")


def test_skip_malformed_counts_and_reports_never_silently(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "a", "label": "1"}, "{oops", {"prompt": ""}, {"prompt": "b", "label": "2"}])
    report = io.StringIO()
    data = PromptDataset(path, skip_malformed=True, report=report)
    assert len(data) == 2 and [p.text for p in (data[0], data[1])] == ["a", "b"]
    assert data.num_malformed == 2 and "train.jsonl:2: invalid JSON" in data.malformed[0]
    assert "skipped 2 malformed lines" in report.getvalue()
    bad = _write_jsonl(tmp_path / "bad.jsonl", ["{oops"])
    with pytest.raises(DataError, match=r"no usable prompts \(1 malformed lines\)"):
        PromptDataset(bad, skip_malformed=True, report=io.StringIO())


def test_parquet_with_nested_fields(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet needs pyarrow (the dev extra)")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["2+2=", "3+3="],
                             "meta": [{"answer": 4}, {"answer": 6}]}), path)
    data = PromptDataset(path, prompt_key="question", label_key="meta.answer")
    assert [(p.text, p.label) for p in (data[0], data[1])] == [("2+2=", "4"), ("3+3=", "6")]
    assert data[1].origin == "train.parquet#row2"
    with pytest.raises(DataError, match=r"no column for field 'answer' \(columns: question, meta\)"):
        PromptDataset(path, prompt_key="question", label_key="answer")
    pq.write_table(pa.table({"prompt": ["ok", ""], "label": ["1", "2"]}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e\.parquet: row 2: field 'prompt' .* empty prompt"):
        PromptDataset(tmp_path / "e.parquet")


def _tiny_tokenizer(directory: Path, *, chat_template: bool = True) -> Path:
    """A character-level tokenizer built offline, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789+=?:<>|/ \n":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    if chat_template:
        fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(str(directory))
    return directory


def test_chat_template_through_a_local_tokenizer(tmp_path):
    tok_dir = _tiny_tokenizer(tmp_path / "tok")
    path = _write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "what is 1+2?", "label": "3"},
        {"prompt": [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "2+2?"}], "label": "4"},
    ])
    encoder = HFEncoder(tok_dir)
    data = PromptDataset(path, encoder=encoder)
    templated = "<|user|>what is 1+2?\n<|assistant|>"
    assert encoder.decode(data[0].prompt_ids) == templated
    assert data[0].prompt_ids == encoder.tokenizer.encode(templated, add_special_tokens=False)
    assert data[0].text == "what is 1+2?"
    assert data[1].text == "2+2?"
    assert encoder.decode(data[1].prompt_ids).startswith("<|system|>be brief\n<|user|>2+2?")
    assert encoder.eos_id == 1

    plain = HFEncoder(tok_dir, apply_chat_template=False)
    assert plain.decode(PromptDataset(path, encoder=plain, label_key=None)[0].prompt_ids) == \
        "what is 1+2?"
    with pytest.raises(DataError, match=r"train\.jsonl:2: chat messages need the chat template"):
        PromptDataset(path, encoder=plain)[1]
    with pytest.raises(DataError, match="no chat template; set data.apply_chat_template: false"):
        HFEncoder(_tiny_tokenizer(tmp_path / "plain", chat_template=False))
    with pytest.raises(DataError, match="data.tokenizer_dir .*: not a directory"):
        HFEncoder(tmp_path / "nope")
    with pytest.raises(DataError, match="chat messages need a chat template: set data.tokenizer_dir"):
        ByteEncoder().encode([{"role": "user", "content": "x"}])


def test_task_dataset_and_build_from_config(tmp_path):
    cfg = config_from_dict({"data": {"digits": 3, "num_eval_prompts": 5}, "run": {"seed": 7}})
    train, held_out = build_datasets(cfg.data, seed=cfg.run.seed)
    task = AdditionTask(digits=3, seed=7)
    assert len(held_out) == 5
    problem = task.problem(11, split="train")
    prompt = train[11]
    assert (prompt.text, prompt.label, prompt.prompt_ids) == (problem.prompt, problem.answer,
                                                              problem.prompt_ids)
    assert held_out[0].text == task.problem(0, split="eval").prompt
    assert train.encoder.decode(encode("12\n")) == "12\n"

    _write_jsonl(tmp_path / "t.jsonl", [{"p": f"{i}+1=", "a": i + 1} for i in range(6)])
    _write_jsonl(tmp_path / "e.jsonl", [{"p": f"{i}+2=", "a": i + 2} for i in range(6)])
    cfg = config_from_dict({"data": {"task": None, "train_path": str(tmp_path / "t.jsonl"),
                                     "eval_path": str(tmp_path / "e.jsonl"), "prompt_key": "p",
                                     "label_key": "a", "num_eval_prompts": 4},
                            "reward": {"kind": "exact_match"}})
    train, held_out = build_datasets(cfg.data, seed=0)
    assert len(train) == 6 and len(held_out) == 4 and held_out[3].label == "5"
    cfg = config_from_dict({"data": {"task": None, "train_path": str(tmp_path / "t.jsonl"),
                                     "prompt_key": "p", "label_key": "a"},
                            "reward": {"kind": "exact_match"}})
    assert build_datasets(cfg.data, seed=0)[1] is None


class _Numbers:
    """A dataset of n prompts whose text is their index."""

    def __init__(self, n: int):
        self.n, self.name, self.encoder = n, f"numbers{n}", ByteEncoder()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return Prompt(index=i, prompt_ids=[i], label=None, text=str(i), origin=f"#{i}")


def _indices(batch):
    return [p.index for p in batch]


def test_sampler_shuffles_each_epoch_deterministically():
    data = _Numbers(10)
    a = PromptSampler(data, seed=3)
    first_two_epochs = _indices(a.next_batch(20))
    assert sorted(first_two_epochs[:10]) == list(range(10)) == sorted(first_two_epochs[10:])
    assert first_two_epochs[:10] != first_two_epochs[10:]  # a new order every epoch
    assert _indices(PromptSampler(data, seed=3).next_batch(20)) == first_two_epochs
    assert _indices(PromptSampler(data, seed=4).next_batch(10)) != first_two_epochs[:10]
    assert _indices(PromptSampler(data, seed=3, shuffle=False).next_batch(12)) == \
        list(range(10)) + [0, 1]
    assert PromptSampler(data, seed=0).next_batch(0) == []


def test_sampler_resumes_exactly_across_epoch_boundaries():
    data = _Numbers(7)
    reference = PromptSampler(data, seed=11)
    expected = [_indices(reference.next_batch(3)) for _ in range(8)]  # 24 prompts, 3+ epochs

    sampler = PromptSampler(data, seed=11)
    got = [_indices(sampler.next_batch(3)) for _ in range(3)]
    state = json.loads(json.dumps(sampler.state_dict()))  # survives a checkpoint as JSON
    assert (state["epoch"], state["index"]) == (1, 2)
    resumed = PromptSampler(data, seed=11)
    resumed.load_state_dict(state)
    got += [_indices(resumed.next_batch(3)) for _ in range(5)]
    assert got == expected

    with pytest.raises(DataError, match=r"num_prompts 7 != 8"):
        PromptSampler(_Numbers(8), seed=11).load_state_dict(state)
    with pytest.raises(DataError, match=r"seed 11 != 12"):
        PromptSampler(data, seed=12).load_state_dict(state)
    with pytest.raises(DataError, match="missing 'index'"):
        PromptSampler(data, seed=11).load_state_dict({"epoch": 0})


def test_task_sampler_is_cheap_and_deterministic():
    train = TaskPromptDataset(AdditionTask(digits=2, seed=0))
    batch = PromptSampler(train, seed=0).next_batch(4)
    assert [p.text for p in batch] == [p.text for p in PromptSampler(train, seed=0).next_batch(4)]
    assert all(p.label == str(eval(p.text[:-1])) for p in batch)
