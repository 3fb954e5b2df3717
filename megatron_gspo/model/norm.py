"""RMSNorm for Megatron's local (non Transformer Engine) layer spec, with sequence parallelism.

Megatron's ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``, yet Megatron requires
sequence parallelism for MoE with tensor parallelism. Under sequence parallelism each TP rank
normalises a different slice of the sequence, so the norm weight's gradient is partial on each rank;
Megatron's ``finalize_model_grads`` sums such gradients over the TP group for every parameter that
carries ``sequence_parallel = True``. This module sets that flag exactly as Transformer Engine's
``TENorm`` does, and computes what Qwen3's ``Qwen3MoeRMSNorm`` computes::

    y = weight * (x_fp32 * rsqrt(mean(x_fp32^2, -1) + eps)).to(x.dtype)

It serves the hidden-state norms (input, pre-MLP, final) and the per-head QK norms.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """Qwen3-style RMSNorm with Megatron's constructor signature and sequence-parallel marking."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype)
        )
        # Summed over TP ranks by finalize_model_grads when sequence parallelism splits the input.
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
