"""The local-spec core attention against a naive per-sequence attention (float64, one process):
packed sequences never see each other, GQA, padded sequence boundaries, blockwise kernel with
every block size, forward and gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.loss.context_parallel import pad_cu_seqlens
from megatron_gspo.model.attention import attention_layout, causal_attention
from tests.unit.attention_reference import naive_causal_attention


def _qkv(total, heads=4, groups=2, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(total, h, dim, generator=gen, dtype=torch.float64)  # noqa: E731
    return make(heads).requires_grad_(), make(groups).requires_grad_(), make(groups).requires_grad_()


def _grads(out, weight, *inputs):
    return torch.autograd.grad((out * weight).sum(), inputs)


KERNEL_CASES = [("blockwise", 1), ("blockwise", 3), ("blockwise", 16), ("blockwise", 1024),
                ("sdpa", None)]


@pytest.mark.parametrize("kernel,block", KERNEL_CASES)
@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("lengths", [[1, 7, 2, 19, 5], [6, 6, 6], [0, 4, 0, 3]],
                         ids=["mixed", "equal", "with_empty"])
def test_packed_matches_naive_forward_and_backward(kernel, block, heads, groups, lengths):
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    q, k, v = _qkv(int(cu[-1]), heads, groups, seed=block or 5)
    weight = torch.randn(q.shape[0], heads, q.shape[-1], dtype=torch.float64)
    out = causal_attention(q, k, v, cu, block=block or 1, kernel=kernel)
    ref = naive_causal_attention(q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    got = _grads(out, weight, q, k, v)
    want = _grads(ref, weight, q, k, v)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, rtol=1e-11, atol=1e-11, msg=f"d{name}")


@pytest.mark.parametrize("kernel", ["blockwise", "sdpa"])
def test_no_attention_across_sequences(kernel):
    """Changing one sequence's tokens leaves every other sequence's output unchanged."""
    cu = torch.tensor([0, 4, 9, 12])
    q, k, v = _qkv(12)
    out = causal_attention(q, k, v, cu, kernel=kernel).detach()
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[4:9] += 1.0
    v2[4:9] -= 2.0
    out2 = causal_attention(q.detach(), k2, v2, cu, kernel=kernel)
    torch.testing.assert_close(out2[:4], out[:4], rtol=0, atol=0)
    torch.testing.assert_close(out2[9:], out[9:], rtol=0, atol=0)
    assert (out2[4:9] - out[4:9]).abs().max() > 1e-3


@pytest.mark.parametrize("kernel", ["blockwise", "sdpa"])
def test_padded_boundaries_keep_real_tokens_exact(kernel):
    """With cu_seqlens padded to a multiple of 4 the real tokens' outputs are those of the
    unpadded pack (padding follows the real tokens of its own sequence)."""
    lengths = torch.tensor([3, 6, 1])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    cu_padded = pad_cu_seqlens(cu, 4)
    q, k, v = _qkv(int(cu_padded[-1]), seed=3)
    out = causal_attention(q, k, v, cu_padded, kernel=kernel)
    real = torch.cat([torch.arange(int(a), int(a) + int(n)) for a, n in zip(cu_padded[:-1], lengths)])
    ref = naive_causal_attention(q[real], k[real], v[real], cu)
    torch.testing.assert_close(out[real], ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["blockwise", "sdpa"])
def test_float32_and_bfloat16_inputs_follow_the_float64_result(kernel):
    cu = torch.tensor([0, 40, 97])
    q, k, v = _qkv(97, seed=4)
    ref = naive_causal_attention(q, k, v, cu)
    out32 = causal_attention(q.float(), k.float(), v.float(), cu, block=32, kernel=kernel)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-6)
    out16 = causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu, block=32, kernel=kernel)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), ref, rtol=0.05, atol=0.05)


def test_layout_of_a_cp_rank_covers_its_causal_prefix():
    """Rank 1 of 2 holds chunks 1 and 2 of a 8-token sequence: queries at positions 2,3,4,5."""
    layout = attention_layout(torch.tensor([0, 8]), cp_rank=1, cp_size=2)
    assert layout.hi_Q.tolist() == [2, 3, 4, 5]
    assert layout.lo_Q.tolist() == [0, 0, 0, 0]
    # gathered order: rank 0 holds [0, 1, 6, 7], rank 1 [2, 3, 4, 5]
    assert layout.gathered_of_K.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert layout.gathered_of_K[layout.order_K].tolist() == list(range(8))


def test_wrong_local_length_is_refused():
    q, k, v = _qkv(10)
    with pytest.raises(ValueError, match="cu_seqlens"):
        causal_attention(q, k, v, torch.tensor([0, 12]))


def test_kernel_choice_is_validated():
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="kernel must be one of"):
        causal_attention(q, k, v, torch.tensor([0, 4]), kernel="flash")


def test_auto_kernel_is_sdpa_without_context_parallelism(monkeypatch):
    """Without CP the default kernel is PyTorch's SDPA, not the plain-torch blockwise one."""
    import megatron_gspo.model.attention as attention

    def refuse(*args, **kwargs):
        raise AssertionError("the blockwise kernel ran without context parallelism")

    monkeypatch.setattr(attention._BlockwiseAttention, "apply", refuse)
    q, k, v = _qkv(9)
    cu = torch.tensor([0, 4, 9])
    torch.testing.assert_close(causal_attention(q, k, v, cu), naive_causal_attention(q, k, v, cu),
                               rtol=1e-12, atol=1e-12)
