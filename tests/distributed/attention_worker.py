"""Spawned-rank side of the context-parallel attention tests (importable for spawn)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gspo.loss.context_parallel import zigzag_split
from megatron_gspo.model.attention import causal_attention


def cp_attention(rank, world_size, q, k, v, weight, cu_padded, block):
    """This rank's zigzag share of q/k/v -> (local output, local dq, dk, dv)."""
    def share(x):
        return zigzag_split(x, rank, world_size, dim=0, cu_seqlens_padded=cu_padded).clone()

    q_l, k_l, v_l = (share(x).requires_grad_() for x in (q, k, v))
    out = causal_attention(q_l, k_l, v_l, cu_padded, cp_group=dist.group.WORLD, block=block)
    grads = torch.autograd.grad((out * share(weight)).sum(), (q_l, k_l, v_l))
    try:  # SDPA's causal mask cannot express the zigzag layout: refused, not silently wrong
        causal_attention(q_l, k_l, v_l, cu_padded, cp_group=dist.group.WORLD, kernel="sdpa")
        sdpa_refused = ""
    except ValueError as err:
        sdpa_refused = str(err)
    return {"out": out.detach(), "grads": [g.detach() for g in grads], "sdpa_refused": sdpa_refused}


def megatron_modules(rank, world_size, q, k, v):
    """Megatron's DotProductAttention and PackedCoreAttention on the same [s, b, h, d] input."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_gspo import parallel
    from megatron_gspo.config import config_from_dict
    from megatron_gspo.model.attention import PackedCoreAttention
    from megatron_gspo.model.gpt import build_transformer_config

    cfg = config_from_dict({"model": {"num_attention_heads": q.shape[2],
                                      "num_query_groups": k.shape[2], "head_dim": q.shape[3]}})
    pg = parallel.initialize(cfg.parallel)
    tcfg = build_transformer_config(cfg.model, cfg.parallel, use_te=False)
    outs, grads = [], []
    for cls in (DotProductAttention, PackedCoreAttention):
        module = cls(config=tcfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                     attention_type="self", pg_collection=pg)
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = module(*inputs, attention_mask=None)
        grads.append(torch.autograd.grad(out.square().sum(), inputs))
        outs.append(out.detach())
    parallel.destroy_model_parallel()
    return {"outs": outs, "grads": grads}
