"""Context-parallel core attention on 2 gloo ranks against a naive per-sequence attention
(float64): every rank holds the zigzag chunks of every packed sequence, K/V are all-gathered,
and the K/V gradients are reduce-scattered back. Outputs and the gradients of q, k and v on each
rank must equal the zigzag share of the single-process reference. Also: the module equals
Megatron's own DotProductAttention on the unpacked [s, b, h, d] layout."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.loss.context_parallel import pad_cu_seqlens, zigzag_split
from tests.distributed import attention_worker
from bench.spawn import run_on_ranks
from tests.unit.attention_reference import naive_causal_attention

CP = 2


def _inputs(lengths, heads=4, groups=2, dim=8, seed=0):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    cu_padded = pad_cu_seqlens(cu, 2 * CP)
    total = int(cu_padded[-1])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(total, groups, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(total, groups, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(total, heads, dim, generator=gen, dtype=torch.float64)
    return q, k, v, weight, cu_padded


@pytest.mark.parametrize("lengths,block", [
    ([1, 13, 4, 40, 2, 7], 5),   # short sequences: some ranks hold only padding of one
    ([37], 1024),                # one long sequence, one block
    ([64, 3], 8),                # many blocks per sequence
])
def test_cp2_matches_naive_attention(lengths, block):
    q, k, v, weight, cu_padded = _inputs(lengths)
    results = run_on_ranks(CP, attention_worker.cp_attention,
                           (q, k, v, weight, cu_padded, block), timeout_s=120)
    q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
    ref = naive_causal_attention(q_, k_, v_, cu_padded)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q_, k_, v_))
    for rank, res in enumerate(results):
        def share(x):
            return zigzag_split(x, rank, CP, dim=0, cu_seqlens_padded=cu_padded)

        torch.testing.assert_close(res["out"], share(ref.detach()), rtol=1e-12, atol=1e-12)
        for name, got, want in zip("qkv", res["grads"], ref_grads):
            torch.testing.assert_close(got, share(want), rtol=1e-11, atol=1e-11,
                                       msg=f"rank {rank} d{name}")
        assert "cannot express the context-parallel zigzag mask" in res["sdpa_refused"]
    # the K/V gradients really needed the other rank's queries (not a local-only result)
    assert float(ref_grads[1].abs().sum()) > 0


def test_module_equals_megatron_dot_product_attention():
    gen = torch.Generator().manual_seed(1)
    seq, batch, heads, groups, dim = 11, 3, 4, 2, 8
    q = torch.randn(seq, batch, heads, dim, generator=gen)
    k = torch.randn(seq, batch, groups, dim, generator=gen)
    v = torch.randn(seq, batch, groups, dim, generator=gen)
    (res,) = run_on_ranks(1, attention_worker.megatron_modules, (q, k, v), timeout_s=120)
    (megatron_out, ours_out), (megatron_grads, ours_grads) = res["outs"], res["grads"]
    assert ours_out.shape == megatron_out.shape == (seq, batch, heads * dim)
    torch.testing.assert_close(ours_out, megatron_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(ours_grads, megatron_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
