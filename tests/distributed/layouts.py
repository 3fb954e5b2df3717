"""Shared fixtures of the layout tests: a tiny policy, its full weights, a batch, and assembly of
the per-rank pieces (HF coordinates) into full tensors."""

from __future__ import annotations

import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes

TINY_MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  head_dim=32, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                  vocab_size=250, make_vocab_size_divisible_by=8)

# name -> (world size, parallel section)
LAYOUTS = {
    "1": (1, {}),
    "DP2": (2, {}),
    "TP2": (2, {"tensor": 2, "sequence_parallel": True}),
    "EP2": (2, {"expert": 2}),
    "PP2": (2, {"pipeline": 2}),
    "TP2xEP2": (4, {"tensor": 2, "sequence_parallel": True, "expert": 2, "expert_tensor": 1}),
    "TP2xEP2xETP2": (4, {"tensor": 2, "sequence_parallel": True, "expert": 2}),
    "PP2xTP2": (4, {"tensor": 2, "sequence_parallel": True, "pipeline": 2}),
    "DP2xPP2": (4, {"pipeline": 2}),
}


def tiny_config(parallel: dict, model: dict | None = None, **sections) -> dict:
    cfg = {"model": {**TINY_MODEL, **(model or {})}, "parallel": dict(parallel),
           # adam_eps 1e-4: Adam's first step is ~lr*sign(g), which turns float rounding of
           # gradient entries near 0 into O(lr) differences; a larger eps keeps the step a smooth
           # function of the gradient, so the weight comparison measures the layout, not rounding.
           "optim": {"optimizer": "adam", "lr": 1e-3, "adam_eps": 1e-4, "clip_grad": 1.0}}
    cfg.update(sections)
    config_from_dict(cfg)  # validate early, in the parent
    return cfg


def random_hf_weights(model_section: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full weights in HF names: norms near 1, matrices small random (fp32)."""
    model = config_from_dict({"model": model_section}).model
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_param_shapes(model).items():
        if len(shape) == 1:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.05 * torch.randn(shape, generator=gen)
    return weights


def assemble(results: list[dict], key: str, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Place every rank's pieces into full tensors; pieces held by several ranks must agree."""
    full = {name: torch.full(shape, float("nan"), dtype=torch.float64) for name, shape in shapes.items()}
    for rank, result in enumerate(results):
        for piece, tensor in result[key]:
            target = full[piece.hf_name][piece.hf_index]
            value = tensor.to(torch.float64)
            seen = ~torch.isnan(target)
            if seen.any():
                assert torch.allclose(target[seen], value[seen], rtol=1e-6, atol=1e-9), (
                    f"{key} {piece.hf_name}: rank {rank} disagrees with another rank holding the "
                    f"same replica (max diff {(target[seen] - value[seen]).abs().max():.3e})")
            full[piece.hf_name][piece.hf_index] = value
    missing = [name for name, t in full.items() if torch.isnan(t).any()]
    assert not missing, f"{key}: no rank provided {missing[:5]}"
    return full


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, tiny): a relative error per tensor."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
