"""Vocabulary-parallel log-probs and entropy against float64 ``torch.log_softmax`` on the full vocabulary.

Run: ``.venv/bin/python -m pytest -q tests/distributed/test_logprobs.py``

Single-process cases cover dtypes, chunk sizes (1, not dividing the token count, larger than it),
temperature, leading batch dims and no-grad use. The tp=2 and tp=4 cases run once per world size
in spawned gloo workers (module fixtures): every rank holds a contiguous vocabulary slice, the
local gradients are concatenated along the vocabulary and compared with autograd through the
float64 reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.loss.logprobs import vocab_parallel_log_probs

from bench.spawn import run_on_ranks

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_case(num_tokens, vocab_size, dtype, seed=0, scale=3.0):
    """Logits (exactly representable in ``dtype``), targets and upstream weights, all float64."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_tokens, vocab_size, generator=gen, dtype=torch.float64) * scale).to(dtype).double()
    target = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    grad_lp = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    grad_ent = torch.randn(num_tokens, generator=gen, dtype=torch.float64)
    return logits, target, grad_lp, grad_ent


def reference(logits, target, grad_lp, grad_ent, temperature, with_entropy):
    """float64 log_softmax on the full vocabulary, entropy from it, and d(objective)/d logits."""
    logits = logits.detach().double().requires_grad_()
    log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    objective = (log_probs * grad_lp).sum() + ((entropy * grad_ent).sum() if with_entropy else 0.0)
    objective.backward()
    return log_probs.detach(), entropy.detach(), logits.grad


def run_ours(logits_local, target, grad_lp, grad_ent, *, temperature, with_entropy, chunk_size, tp_group=None,
             vocab_start=None):
    logits_local = logits_local.detach().clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(logits_local, target, tp_group=tp_group, vocab_start=vocab_start,
                                                  chunk_size=chunk_size, temperature=temperature,
                                                  with_entropy=with_entropy)
    objective = (log_probs.double() * grad_lp).sum()
    if with_entropy:
        objective = objective + (entropy.double() * grad_ent).sum()
    objective.backward()
    return log_probs.detach(), (entropy.detach() if with_entropy else None), logits_local.grad


def assert_matches(ours, ref, dtype, with_entropy, grad_tol=None):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours[0].double(), ref[0], rtol=0, atol=tol)
    if with_entropy:
        torch.testing.assert_close(ours[1].double(), ref[1], rtol=0, atol=tol)
    else:
        assert ours[1] is None
    assert ours[2].dtype == dtype
    torch.testing.assert_close(ours[2].double(), ref[2], rtol=0, atol=grad_tol or tol)


# ---------------------------------------------------------------------------------------------
# tp = 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_single_rank_matches_float64_log_softmax(dtype, chunk_size, temperature, with_entropy):
    logits, target, grad_lp, grad_ent = make_case(37, 1003, dtype)
    ours = run_ours(logits.to(dtype), target, grad_lp, grad_ent, temperature=temperature,
                    with_entropy=with_entropy, chunk_size=chunk_size)
    assert_matches(ours, reference(logits, target, grad_lp, grad_ent, temperature, with_entropy), dtype,
                   with_entropy)


def test_bfloat16_logits_compute_in_float32():
    logits, target, grad_lp, grad_ent = make_case(33, 517, torch.bfloat16)
    ours = run_ours(logits.to(torch.bfloat16), target, grad_lp, grad_ent, temperature=0.8, with_entropy=True,
                    chunk_size=8)
    ref = reference(logits, target, grad_lp, grad_ent, 0.8, True)
    torch.testing.assert_close(ours[0].double(), ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1].double(), ref[1], rtol=0, atol=1e-5)
    assert ours[2].dtype == torch.bfloat16
    # the gradient is rounded to bfloat16 once (relative 2^-8)
    torch.testing.assert_close(ours[2].double(), ref[2], rtol=2 ** -8, atol=1e-6)


def test_leading_batch_dims_and_no_grad():
    logits, target, grad_lp, grad_ent = make_case(24, 211, torch.float64)
    flat = vocab_parallel_log_probs(logits, target, chunk_size=5, with_entropy=True)
    with torch.no_grad():
        shaped = vocab_parallel_log_probs(logits.view(2, 3, 4, 211), target.view(2, 3, 4), chunk_size=5,
                                          with_entropy=True)
    assert shaped[0].shape == (2, 3, 4) and not shaped[0].requires_grad
    assert torch.equal(shaped[0].reshape(-1), flat[0]) and torch.equal(shaped[1].reshape(-1), flat[1])


def test_gradient_through_entropy_only():
    logits, target, grad_lp, grad_ent = make_case(9, 50, torch.float64)
    x = logits.clone().requires_grad_()
    _, entropy = vocab_parallel_log_probs(x, target, chunk_size=4, with_entropy=True)
    (entropy * grad_ent).sum().backward()
    ref = reference(logits, target, torch.zeros_like(grad_lp), grad_ent, 1.0, True)
    torch.testing.assert_close(x.grad, ref[2], rtol=0, atol=1e-12)


def test_zero_tokens():
    logits = torch.zeros(0, 7, requires_grad=True)
    log_probs, entropy = vocab_parallel_log_probs(logits, torch.zeros(0, dtype=torch.long), with_entropy=True)
    (log_probs.sum() + entropy.sum()).backward()
    assert log_probs.shape == (0,) and logits.grad.shape == (0, 7)


def test_argument_errors():
    logits = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_log_probs(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(logits, torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_log_probs(logits, torch.zeros(3, dtype=torch.long), chunk_size=0)


# ---------------------------------------------------------------------------------------------
# tp = 2, 4 (spawned gloo ranks)

# (name, num_tokens, vocab_size, dtype, chunk_size, temperature, with_entropy, uneven_split)
TP_CASES = [
    ("f64-chunk7-temp0.7", 29, 1000, torch.float64, 7, 0.7, True, False),
    ("f64-chunk1", 5, 64, torch.float64, 1, 1.0, True, False),
    ("f64-no-entropy-chunk100", 29, 1000, torch.float64, 100, 1.3, False, False),
    ("f32-chunk16-temp0.7", 40, 1000, torch.float32, 16, 0.7, True, False),
    ("f64-uneven-split", 17, 1001, torch.float64, 6, 1.0, True, True),
    ("f32-vocab151936", 16, 151936, torch.float32, 4096, 1.0, True, False),
]


def _slices(vocab_size, tp, uneven):
    """Contiguous [start, end) per rank; 'uneven' gives rank 0 fewer entries than the others."""
    if not uneven:
        assert vocab_size % tp == 0, "an even split (default vocab_start) needs V divisible by tp"
        size = vocab_size // tp
        return [(r * size, (r + 1) * size) for r in range(tp)]
    cuts = [0] + [vocab_size * (r + 1) // tp + (1 if r < tp - 1 else 0) for r in range(tp)]
    cuts[-1] = vocab_size
    cuts[1] -= 3
    return list(zip(cuts[:-1], cuts[1:]))


def _tp_worker(rank, world_size, cases):
    out = {}
    for name, num_tokens, vocab_size, dtype, chunk_size, temperature, with_entropy, uneven in cases:
        if world_size == 4 and vocab_size > 10_000:
            continue  # see TP_PARAMS
        logits, target, grad_lp, grad_ent = make_case(num_tokens, vocab_size, dtype)
        start, end = _slices(vocab_size, world_size, uneven)[rank]
        # the even split must work with the default vocab_start = rank * V_local
        vocab_start = start if uneven else None
        out[name] = run_ours(logits[:, start:end].to(dtype), target, grad_lp, grad_ent, temperature=temperature,
                             with_entropy=with_entropy, chunk_size=chunk_size, tp_group=dist.group.WORLD,
                             vocab_start=vocab_start)
    return out


@pytest.fixture(scope="module")
def tp_results():
    return {tp: run_on_ranks(tp, _tp_worker, args=(TP_CASES,)) for tp in (2, 4)}


# the large-vocabulary case runs at tp=2 only (time on 2 cores)
TP_PARAMS = [pytest.param(tp, case, id=f"tp{tp}-{case[0]}") for tp in (2, 4) for case in TP_CASES
             if tp == 2 or case[2] <= 10_000]


@pytest.mark.parametrize(("tp", "case"), TP_PARAMS)
def test_vocab_parallel_matches_float64_log_softmax(tp_results, tp, case):
    name, num_tokens, vocab_size, dtype, chunk_size, temperature, with_entropy, uneven = case
    logits, target, grad_lp, grad_ent = make_case(num_tokens, vocab_size, dtype)
    ref = reference(logits, target, grad_lp, grad_ent, temperature, with_entropy)
    per_rank = [r[name] for r in tp_results[tp]]
    for log_probs, entropy, _ in per_rank:  # every rank returns the full per-token values
        torch.testing.assert_close(log_probs, per_rank[0][0], rtol=0, atol=0)
    grad = torch.cat([g for _, _, g in per_rank], dim=-1)
    assert grad.shape == (num_tokens, vocab_size)
    assert_matches((per_rank[0][0], per_rank[0][1], grad), ref, dtype, with_entropy)
