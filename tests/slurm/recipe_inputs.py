"""Stand-ins for the paths a GPU recipe names (a converted checkpoint, a math JSONL, a local
tokenizer with a chat template), so that ``config``, ``plan`` and ``launch slurm --dry-run`` can
check a recipe end to end on any machine: ``recipe_overrides(tmp_path)`` writes them and returns
the ``--set`` overrides that point the recipe at them."""

from __future__ import annotations

import json
from pathlib import Path


def tiny_chat_tokenizer(directory: Path) -> Path:
    """A character-level Hugging Face tokenizer with a chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789+-*/=?:<>|()^{}\\$.,' \n":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast.save_pretrained(str(directory))
    return directory


def recipe_overrides(root: Path) -> list[str]:
    """Write the stand-ins under ``root``; the ``section.key=value`` overrides that use them."""
    root.mkdir(parents=True, exist_ok=True)
    init = root / "mcore"
    init.mkdir(exist_ok=True)  # a converted checkpoint's directory (its files are not read here)
    rows = [{"prompt": [{"role": "user", "content": "what is 12 * 12? answer in \\boxed{}."}],
             "label": "144"},
            {"prompt": [{"role": "user", "content": "solve x + 3 = 10 for x."}], "label": "7"}]
    for name in ("train.jsonl", "eval.jsonl"):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = tiny_chat_tokenizer(root / "tokenizer")
    return [f"run.init_from={init}", f"data.train_path={root / 'train.jsonl'}",
            f"data.eval_path={root / 'eval.jsonl'}", f"data.tokenizer_dir={tokenizer}"]
