"""A tiny random Qwen3-MoE directory with a local tokenizer, for the rollout tests and benchmark.

The model comes from ``bench/hf_tiny.py`` (the conversion tests' builder); the tokenizer is a
word-level ``tokenizers`` tokenizer saved next to it, because the sglang-router loads a tokenizer
from the worker's ``model_path`` and must never reach for the Hugging Face Hub.
"""

from __future__ import annotations

from pathlib import Path

from bench.hf_tiny import build_hf_model

EOS_ID = 1
CASE = "gqa2_untied"  # vocab 259, GQA 2, head_dim 24, 4 experts top-2, untied


def save_tokenizer(directory: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": EOS_ID}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789+=?":
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<w{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(directory))


def make_model_dir(directory: Path, *, seed: int = 0, num_layers: int = 2,
                   tokenizer: bool = True, **shape: int) -> Path:
    """Save a random tiny Qwen3-MoE (fp32 safetensors) and, optionally, its tokenizer;
    ``shape``: more of ``build_hf_model``'s sizes (num_experts, num_experts_per_tok)."""
    model = build_hf_model(CASE, seed=seed, num_layers=num_layers, **shape)  # 256 positions
    model.config.eos_token_id = EOS_ID
    model.generation_config.eos_token_id = EOS_ID
    directory = Path(directory)
    model.save_pretrained(directory)
    if tokenizer:
        save_tokenizer(directory, model.config.vocab_size)
    return directory
