"""Tiny random Qwen3-MoE models built with transformers: the judges of the conversion tests and
of bench/gpu_smoke.py's conversion check (here, so that bench/ does not import tests/).

``CASES`` cover head_dim != hidden / heads, GQA ratios 2 and 4, tied and untied embeddings, both
``norm_topk_prob`` settings and vocabularies that TP = 2 (times Megatron's divisor 8) does not
divide. Weights are drawn so that the model is far from uniform: matrices ~ N(0, 1/fan_in), norm
weights 1 + 0.2 N(0, 1), so log-probs spread over several nats and routing is decisive.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

CASES: dict[str, dict] = {
    # GQA ratio 2, head_dim 24 (hidden/heads = 16), untied, renormalised top-k, vocab 259
    "gqa2_untied": dict(vocab_size=259, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        norm_topk_prob=True, tie_word_embeddings=False, rope_theta=10000.0),
    # GQA ratio 4, head_dim 16 (hidden/heads = 8), tied, plain top-k softmax, vocab 261
    "gqa4_tied": dict(vocab_size=261, hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=False, tie_word_embeddings=True, rope_theta=1_000_000.0),
}


def hf_config(case: str, num_layers: int = 2, **overrides):
    from transformers import Qwen3MoeConfig

    values = dict(CASES[case], **overrides)
    rope_theta = values.pop("rope_theta")
    return Qwen3MoeConfig(num_hidden_layers=num_layers, intermediate_size=96,
                          max_position_embeddings=256,
                          rope_parameters={"rope_theta": rope_theta, "rope_type": "default"},
                          **values)


def build_hf_model(case: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A random transformers ``Qwen3MoeForCausalLM`` in eval mode."""
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(hf_config(case, **overrides)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1:
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
    return model.to(dtype)


def save_hf_model(model, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, **kwargs)
    return Path(directory)


def random_batch(vocab_size: int, rows: int = 2, seq: int = 16, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).expand(rows, seq).contiguous()}


@torch.no_grad()
def hf_log_probs(model, batch: dict) -> torch.Tensor:
    """Per-token log p(label) from transformers' forward, float64 log-softmax of its logits."""
    logits = model(batch["tokens"]).logits.double()
    return torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0]


def load_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors
