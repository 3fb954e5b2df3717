"""Context-parallel loss plumbing: layouts, packed sums, and exact gradients over (dp, cp) splits.

Run: ``.venv/bin/python -m pytest -q tests/distributed/test_context_parallel.py``

The loss-level tests build one global batch (uneven lengths, prompt tokens, sequences shorter than
2*cp, fully masked rows, an empty row), compute the float64 single-process reference
(``gspo_reference.naive_loss``), then spread it over (dp, cp) ranks in the zigzag [B, T] layout and
in the packed THD layout, run the loss on every rank with ``loss_denominator = N`` from
``global_num_sequences`` and ``sequence_reduce = make_sequence_reduce(cp_group)``, and place every
rank's gradient w.r.t. its own per-token log-probs back in the global layout. The spawned runs
happen once per world size (module fixtures); the parametrised tests only compare.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from megatron_gspo.loss.context_parallel import (
    SequenceAllReduce,
    local_cu_seqlens,
    make_sequence_reduce,
    pad_cu_seqlens,
    pad_to_multiple,
    packed_to_rows,
    per_sequence_sums,
    rows_to_packed,
    segment_ids,
    zigzag_gather,
    zigzag_indices,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)
from megatron_gspo.loss.loss_scaling import global_num_sequences

from tests.distributed import gspo_reference
from bench.spawn import run_on_ranks

try:
    from megatron_gspo.loss.gspo import gspo_loss
except ImportError:  # written concurrently; the tests then use the stand-in only
    gspo_loss = None

IMPLEMENTATIONS = ("rowwise_reference",) + (("gspo_loss",) if gspo_loss is not None else ())
LAYOUTS = ("zigzag", "packed")
DTYPES = ("float64", "float32")
EPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (1e-3, 1.2e-3)}
TOLERANCE = {"float64": 1e-10, "float32": 1e-6}
SPLITS = ((1, 1), (2, 1), (1, 2), (2, 2))


# ---------------------------------------------------------------------------------------------
# layout unit tests (single process)


def test_zigzag_chunk_assignment_cp2():
    x = torch.arange(8)[None]
    assert zigzag_split(x, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert zigzag_split(x, 1, 2).tolist() == [[2, 3, 4, 5]]
    assert zigzag_positions(torch.tensor([0, 8]), 1, 2).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_zigzag_roundtrip(cp):
    x = torch.randn(3, 8 * cp, 2)
    shares = [zigzag_split(x, r, cp) for r in range(cp)]
    assert all(s.shape == (3, 8, 2) for s in shares)
    assert torch.equal(zigzag_unsplit(shares), x)


def test_zigzag_requires_padding():
    x = torch.arange(6)[None]
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 4"):
        zigzag_split(x, 0, 2)
    padded = pad_to_multiple(x, 4, value=-1)
    assert padded.tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    assert zigzag_split(x, 0, 1).tolist() == [[0, 1, 2, 3, 4, 5]]  # cp=1: no padding needed


def test_packed_zigzag_each_sequence_split_on_its_own():
    cu = torch.tensor([0, 3, 8, 9])
    cu_pad = pad_cu_seqlens(cu, 4)
    assert cu_pad.tolist() == [0, 4, 12, 16]
    # rank 0: chunks 0 and 3 of every sequence; chunk sizes 1, 2, 1
    assert zigzag_indices(cu_pad, 0, 2).tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert zigzag_indices(cu_pad, 1, 2).tolist() == [1, 2, 6, 7, 8, 9, 13, 14]
    assert local_cu_seqlens(cu_pad, 2).tolist() == [0, 2, 6, 8]
    assert zigzag_positions(cu_pad, 1, 2).tolist() == [1, 2, 2, 3, 4, 5, 1, 2]
    x = torch.arange(16.0)
    shares = [zigzag_split(x, r, 2, dim=0, cu_seqlens_padded=cu_pad) for r in range(2)]
    assert torch.equal(zigzag_unsplit(shares, dim=0, cu_seqlens_padded=cu_pad), x)


def test_segment_ids_and_sums_match_loop():
    cu = torch.tensor([0, 2, 2, 7])
    ids = segment_ids(cu, 9)
    assert ids.tolist() == [0, 0, 2, 2, 2, 2, 2, -1, -1]
    values = torch.randn(9, 3, dtype=torch.float64)
    sums = per_sequence_sums(values, ids, 3)
    expected = torch.stack([values[0:2].sum(0), values[2:2].sum(0), values[2:7].sum(0)])
    torch.testing.assert_close(sums, expected, rtol=0, atol=1e-14)


def test_packed_rows_roundtrip_and_gradient():
    cu = torch.tensor([0, 3, 3, 8])
    values = torch.randn(10, dtype=torch.float64, requires_grad=True)
    rows = packed_to_rows(values, cu)
    assert rows.shape == (3, 5)
    assert rows[1].abs().sum() == 0 and rows[0, 3:].abs().sum() == 0
    mask = packed_to_rows(torch.ones(10, dtype=torch.bool), cu, fill_value=False)
    assert mask.sum(1).tolist() == [3, 0, 5]
    back = rows_to_packed(rows, cu, 10)
    assert torch.equal(back[:8], values[:8].detach()) and back[8:].abs().sum() == 0
    weights = torch.randn(3, 5, dtype=torch.float64)
    (rows * weights).sum().backward()
    assert torch.equal(values.grad, rows_to_packed(weights * mask, cu, 10))


def test_global_num_sequences_single_process_inputs():
    mask = torch.tensor([[True, False], [False, False], [False, True]])
    assert global_num_sequences(mask, dp_group=None, cp_group=None) == 2
    assert global_num_sequences(torch.tensor([3, 0, 1, 0]), dp_group=None, cp_group=None) == 2
    assert global_num_sequences([mask, torch.tensor([0, 5])], dp_group=None, cp_group=None) == 3  # micro-batches


def test_no_cp_reduce_is_identity():
    x = torch.randn(4, 2)
    assert make_sequence_reduce(None)(x) is x


# ---------------------------------------------------------------------------------------------
# the global problem


@functools.lru_cache(maxsize=None)
def make_problem(seed: int = 0):
    """A global batch in float64 whose values are exactly representable in float32.

    Rows: [prompt tokens (mask False) | response tokens (mask True) | padding]. Includes response
    lengths 1 and 2 (shorter than 2*cp chunks), a fully masked row (prompt only) and an empty row.
    Re-draws until no ratio lies within 1e-6 of a clip boundary, so float32 and float64 take the
    same clip decisions.
    """
    prompt_lens = [2, 0, 3, 1, 4, 2, 0, 3, 0]
    response_lens = [5, 1, 0, 11, 2, 7, 3, 6, 0]  # row 2: prompt only; row 8: empty
    num_sequences = len(prompt_lens)
    total_lens = [p + r for p, r in zip(prompt_lens, response_lens)]
    max_len = max(total_lens)
    mask = torch.zeros(num_sequences, max_len, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[i, p:p + r] = True
    for attempt in range(100):
        gen = torch.Generator().manual_seed(seed * 1000 + attempt)
        old = -torch.rand(num_sequences, max_len, generator=gen, dtype=torch.float64) * 5 - 0.1
        bias = (torch.rand(num_sequences, 1, generator=gen, dtype=torch.float64) * 2 - 1) * 1e-3
        noise = torch.randn(num_sequences, max_len, generator=gen, dtype=torch.float64) * 1e-3
        new = (old + bias + noise).float().double()
        old = old.float().double()
        adv = torch.randn(num_sequences, generator=gen, dtype=torch.float64).float().double()
        adv[4] = 0.0
        if _margins_ok(new, old, mask):
            return dict(new=new, old=old, adv=adv, mask=mask, total_lens=total_lens)
    raise RuntimeError("no draw with safe clip margins")


def _margins_ok(new, old, mask) -> bool:
    log_ratio = (new - old) * mask
    counts = mask.sum(1).clamp(min=1)
    s = torch.exp(log_ratio.sum(1) / counts)
    w = torch.exp(new - old)[mask]
    for low, high in EPS.values():
        for r in (s, w):
            if bool(((r - (1 + high)).abs() < 1e-6).any() or ((r - (1 - low)).abs() < 1e-6).any()):
                return False
    return True


@functools.lru_cache(maxsize=None)
def reference(variant: str):
    """(loss, grad w.r.t. every token's log-prob [S, T], N) from the naive float64 loop."""
    p = make_problem()
    new = p["new"].clone().requires_grad_()
    eps_low, eps_high = EPS[variant]
    loss, num_sequences = gspo_reference.naive_loss(new, p["old"], p["adv"], p["mask"], variant=variant,
                                                     eps_low=eps_low, eps_high=eps_high)
    loss.backward()
    return loss.item(), new.grad.clone(), num_sequences


def test_problem_has_clipped_and_unclipped_units():
    p = make_problem()
    nonempty = p["mask"].any(1) & (p["adv"] != 0)
    s = torch.exp(((p["new"] - p["old"]) * p["mask"]).sum(1) / p["mask"].sum(1).clamp(min=1))
    cut = gspo_reference._cut(s, p["adv"], *EPS["gspo"])[nonempty]
    assert 0 < int(cut.sum()) < int(nonempty.sum())
    w = torch.exp(p["new"] - p["old"])
    cut_tokens = gspo_reference._cut(w, p["adv"][:, None], *EPS["grpo"])[p["mask"]]
    assert 0 < int(cut_tokens.sum()) < int(p["mask"].sum())


def test_rowwise_stand_in_matches_naive_reference():
    p = make_problem()
    for variant in gspo_reference.VARIANTS:
        new = p["new"].clone().requires_grad_()
        loss, _ = gspo_reference.rowwise_loss(new, p["old"], p["adv"], p["mask"], eps_low=EPS[variant][0],
                                              eps_high=EPS[variant][1], variant=variant)
        loss.backward()
        ref_loss, ref_grad, _ = reference(variant)
        assert abs(loss.item() - ref_loss) < 1e-13
        torch.testing.assert_close(new.grad, ref_grad, rtol=0, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# one rank's share of the problem, in both layouts


def _shard(num_sequences: int, dp: int, dp_rank: int) -> list[int]:
    """Contiguous, uneven shards (9 sequences over 2 ranks: 5 + 4)."""
    return [int(i) for i in torch.arange(num_sequences).tensor_split(dp)[dp_rank]]


def build_local(problem, shard, cp_rank, cp, layout, dtype):
    """This rank's per-token tensors and the global (sequence, position) of every local token."""
    new, old, mask = problem["new"][shard], problem["old"][shard], problem["mask"][shard]
    total_lens = [problem["total_lens"][i] for i in shard]
    shard_t = torch.tensor(shard)
    multiple = 2 * cp if cp > 1 else 1
    if layout == "zigzag":
        row_len = max(max(total_lens), 1)
        new, old, mask = (pad_to_multiple(x[:, :row_len], multiple, value=v)
                          for x, v in ((new, 0.0), (old, 0.0), (mask, False)))
        cu_row = torch.tensor([0, new.shape[1]])
        local = [zigzag_split(x, cp_rank, cp) for x in (new, old, mask)]
        pos = zigzag_indices(cu_row, cp_rank, cp)[None].expand(len(shard), -1)
        seq = shard_t[:, None].expand_as(pos)
        return dict(new=local[0].to(dtype), old=local[1].to(dtype), mask=local[2], seq=seq.reshape(-1),
                     pos=pos.reshape(-1), counts=local[2], cu_local=None)
    # packed THD: sequences back to back, each padded to a multiple of 2*cp, plus 2 tokens of
    # trailing row padding (segment id -1) on every rank.
    cu = torch.tensor([0] + total_lens).cumsum(0)
    cu_pad = pad_cu_seqlens(cu, multiple)
    packed = {k: torch.zeros(int(cu_pad[-1]), dtype=v.dtype) for k, v in (("new", new), ("old", old), ("mask", mask))}
    for j, length in enumerate(total_lens):
        start = int(cu_pad[j])
        for k, v in (("new", new), ("old", old), ("mask", mask)):
            packed[k][start:start + length] = v[j, :length]
    index = zigzag_indices(cu_pad, cp_rank, cp)
    seg = segment_ids(cu_pad, int(cu_pad[-1]))[index]
    seq = torch.cat([shard_t[seg], torch.full((2,), -1)])
    pos = torch.cat([index - cu_pad[seg], torch.zeros(2, dtype=torch.long)])
    local = {k: torch.cat([v[index], v.new_zeros(2)]) for k, v in packed.items()}
    cu_local = local_cu_seqlens(cu_pad, cp)
    counts = per_sequence_sums(local["mask"].long(), segment_ids(cu_local, len(local["mask"])), len(shard))
    return dict(new=local["new"].to(dtype), old=local["old"].to(dtype), mask=local["mask"], seq=seq, pos=pos,
                counts=counts, cu_local=cu_local)


def local_rows(local, new_leaf):
    """The [S_local, L] rows the loss sees: identity for zigzag, packed_to_rows for packed."""
    if local["cu_local"] is None:
        return new_leaf, local["old"], local["mask"]
    cu = local["cu_local"]
    return (packed_to_rows(new_leaf, cu), packed_to_rows(local["old"], cu),
            packed_to_rows(local["mask"], cu, fill_value=False))


def _loss_fn(impl):
    return gspo_reference.rowwise_loss if impl == "rowwise_reference" else gspo_loss


def run_split(rank, dp, cp, dp_group, cp_group):
    """Every (dtype, layout, variant, implementation) on one rank of a (dp, cp) split."""
    dp_rank, cp_rank = divmod(rank, cp)
    problem = make_problem()
    shard = _shard(problem["new"].shape[0], dp, dp_rank)
    adv = problem["adv"][shard]
    reduce = make_sequence_reduce(cp_group)
    out = {}
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        for layout in LAYOUTS:
            local = build_local(problem, shard, cp_rank, cp, layout, dtype)
            num_sequences = global_num_sequences(local["counts"], dp_group=dp_group, cp_group=cp_group)
            for variant in gspo_reference.VARIANTS:
                for impl in IMPLEMENTATIONS:
                    new_leaf = local["new"].clone().requires_grad_()
                    rows_new, rows_old, rows_mask = local_rows(local, new_leaf)
                    loss, _ = _loss_fn(impl)(rows_new, rows_old, adv.to(dtype), rows_mask,
                                             eps_low=EPS[variant][0], eps_high=EPS[variant][1], variant=variant,
                                             loss_denominator=num_sequences, sequence_reduce=reduce)
                    loss.backward()
                    out[(dtype_name, layout, variant, impl)] = dict(
                        loss=loss.item(), grad=new_leaf.grad.double().reshape(-1), seq=local["seq"],
                        pos=local["pos"], num_sequences=num_sequences, dp_rank=dp_rank, cp_rank=cp_rank)
    return out


def _groups(rank, dp, cp):
    """(dp_group, cp_group) for rank = dp_rank * cp + cp_rank; every rank creates every group."""
    dp_group = cp_group = None
    for d in range(dp):
        group = dist.new_group([d * cp + c for c in range(cp)])
        if rank // cp == d:
            cp_group = group
    for c in range(cp):
        group = dist.new_group([d * cp + c for d in range(dp)])
        if rank % cp == c:
            dp_group = group
    return dp_group, cp_group


def _split_worker(rank, world_size, splits):
    results = {}
    for dp, cp in splits:
        assert dp * cp == world_size
        dp_group, cp_group = _groups(rank, dp, cp)
        results[(dp, cp)] = run_split(rank, dp, cp, dp_group, cp_group)
    if world_size == 2:
        results["sequence_all_reduce"] = _check_sequence_all_reduce(rank)
        results["zigzag_gather"] = _check_zigzag_gather(rank, world_size)
    return results


def _check_sequence_all_reduce(rank):
    """Forward sums over the group; backward hands dL/dsum to each rank unchanged."""
    x = torch.full((3, 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    total = SequenceAllReduce.apply(x, dist.group.WORLD)
    weights = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    (total * total * weights).sum().backward()
    return total.detach(), x.grad  # expect total = 3, grad = 2 * 3 * weights on both ranks


def _check_zigzag_gather(rank, world_size):
    x = torch.arange(16.0).reshape(2, 8)
    return zigzag_gather(zigzag_split(x, rank, world_size), dist.group.WORLD)


@pytest.fixture(scope="module")
def split_results():
    """{(dp, cp): [per-rank result dict]}: (1,1) in process, world 2 and world 4 spawned once."""
    results = {(1, 1): [run_split(0, 1, 1, None, None)]}
    by_rank = run_on_ranks(2, _split_worker, args=(((2, 1), (1, 2)),))
    for key in ((2, 1), (1, 2)):
        results[key] = [r[key] for r in by_rank]
    results["world2_checks"] = by_rank
    by_rank = run_on_ranks(4, _split_worker, args=(((2, 2),),))
    results[(2, 2)] = [r[(2, 2)] for r in by_rank]
    return results


def test_sequence_all_reduce_forward_sum_backward_identity(split_results):
    weights = torch.arange(6, dtype=torch.float64).reshape(3, 2)
    for r in split_results["world2_checks"]:
        total, grad = r["sequence_all_reduce"]
        assert torch.equal(total, torch.full((3, 2), 3.0, dtype=torch.float64))
        assert torch.equal(grad, 2 * 3 * weights)
        assert torch.equal(r["zigzag_gather"], torch.arange(16.0).reshape(2, 8))


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("variant", gspo_reference.VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", SPLITS, ids=[f"dp{d}-cp{c}" for d, c in SPLITS])
def test_gradients_and_loss_match_single_process(split_results, split, layout, variant, impl, dtype_name):
    ref_loss, ref_grad, ref_n = reference(variant)
    per_rank = [r[(dtype_name, layout, variant, impl)] for r in split_results[split]]
    tol = TOLERANCE[dtype_name]
    grad = torch.zeros_like(ref_grad)
    coverage = torch.zeros_like(ref_grad)
    max_len = ref_grad.shape[1]
    for r in per_rank:
        assert r["num_sequences"] == ref_n
        is_in_global = (r["seq"] >= 0) & (r["pos"] < max_len)
        # tokens outside the global rows are padding: no gradient may reach them
        assert bool((r["grad"][~is_in_global] == 0).all())
        seq, pos = r["seq"][is_in_global], r["pos"][is_in_global]
        grad.index_put_((seq, pos), r["grad"][is_in_global], accumulate=True)
        coverage.index_put_((seq, pos), torch.ones_like(r["grad"][is_in_global]), accumulate=True)
    problem = make_problem()
    assert bool((coverage[problem["mask"]] == 1).all()), "every response token on exactly one rank"
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=tol)

    dp, cp = split
    for d in range(dp):
        copies = [r["loss"] for r in per_rank if r["dp_rank"] == d]
        assert max(copies) - min(copies) <= tol, "CP ranks of one group hold the same loss copy"
    loss_over_dp = sum(r["loss"] for r in per_rank if r["cp_rank"] == 0)
    assert abs(loss_over_dp - ref_loss) <= tol
