"""Token-budget packing: the partitioner (balance, equal counts, nothing lost, budget respected,
clear errors) and the packed / zigzag micro-batch layouts (round trips against the padded rows)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_gspo.loss.context_parallel import zigzag_unsplit
from megatron_gspo.train.batching import (BUDGET_FIELD, add_logit_index, loss_rows,
                                          pack_micro_batch, pack_tokens, packed_micro_batches,
                                          plan_micro_batches, response_counts, rl_batch,
                                          sequence_lengths, split_rows_for_context_parallel)


def _lognormal_lengths(n, seed, median=100, sigma=0.6):
    rng = random.Random(seed)
    return [max(1, int(math.exp(rng.gauss(math.log(median), sigma)))) for _ in range(n)]


LAYOUTS = [(1, 1, 1, 1024), (2, 1, 1, 1024), (4, 1, 1, 700), (2, 2, 1, 300), (2, 2, 2, 512),
           (1, 4, 1, 256)]


@pytest.mark.parametrize("dp,cp,tp,budget", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_plan_is_a_balanced_partition_within_budget(dp, cp, tp, budget, seed):
    lengths = _lognormal_lengths(200, seed)
    plan = plan_micro_batches(lengths, budget, dp, cp_size=cp, tp_size=tp)
    assert len(plan) == dp
    counts = {len(rank) for rank in plan}
    assert len(counts) == 1, f"unequal micro-batch counts per rank: {counts}"
    placed = sorted(i for rank in plan for mb in rank for i in mb)
    assert placed == list(range(len(lengths))), "a sequence was lost or placed twice"
    packs = [pack_tokens([lengths[i] for i in mb], cp, tp) for rank in plan for mb in rank]
    assert max(packs) <= budget * cp
    loads = [sum(pack_tokens([lengths[i] for i in mb], cp, tp) for mb in rank) for rank in plan]
    mean = sum(loads) / dp
    assert max(loads) <= 1.02 * mean, f"rank token loads {loads}"
    # the micro-batch count is within one of the lower bound set by the budget
    lower = math.ceil(sum(packs) / (dp * budget * cp))
    assert len(plan[0]) <= lower + 1


def test_plan_uses_few_micro_batches_and_fills_them():
    lengths = [100] * 40
    plan = plan_micro_batches(lengths, 1000, 2)
    assert [len(r) for r in plan] == [2, 2]
    assert all(len(mb) == 10 for r in plan for mb in r)


def test_plan_gives_every_rank_micro_batches_even_with_few_sequences():
    plan = plan_micro_batches([5, 9, 3], 100, 2)
    assert [len(r) for r in plan] == [1, 1]
    assert sorted(i for r in plan for mb in r for i in mb) == [0, 1, 2]
    plan = plan_micro_batches([5], 100, 2)  # one rank gets an empty (padding-only) pack
    assert sorted(len(mb) for r in plan for mb in r) == [0, 1]


def test_sequence_longer_than_budget_names_the_field():
    with pytest.raises(ValueError, match=BUDGET_FIELD.replace(".", r"\.")) as err:
        plan_micro_batches([10, 300, 20], 256, 1)
    assert "sequence 1" in str(err.value) and "300 tokens" in str(err.value)
    # with cp=2, tp=2 the per-rank budget counts the padded share
    with pytest.raises(ValueError, match="per context-parallel rank"):
        plan_micro_batches([30], 8, 1, cp_size=2, tp_size=2)
    assert plan_micro_batches([30], 16, 1, cp_size=2, tp_size=2) == [[[0]]]


def _rl_rows(seed=0, lengths=((3, 5), (1, 1), (6, 20), (2, 0), (4, 9)), seq=32):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 200, (p,), generator=gen).tolist() for p, _ in lengths]
    outputs = [torch.randint(1, 200, (r,), generator=gen).tolist() for _, r in lengths]
    lps = [(-torch.rand(len(o), generator=gen)).tolist() for o in outputs]
    adv = torch.randn(len(lengths), generator=gen)
    return rl_batch(prompts, outputs, lps, adv, seq, 0)


def test_rl_batch_lengths_cover_every_label_position():
    batch = _rl_rows()
    assert batch["lengths"].tolist() == [7, 1, 25, 1, 12]
    # nothing the loss sees lies beyond a row's length
    for row, n in enumerate(batch["lengths"].tolist()):
        assert not batch["response_mask"][row, n:].any()
    assert torch.equal(sequence_lengths({k: v for k, v in batch.items() if k != "lengths"})[[0, 2, 4]],
                       batch["lengths"][[0, 2, 4]])


@pytest.mark.parametrize("cp,tp", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)])
def test_packed_shares_reassemble_into_the_padded_rows(cp, tp):
    batch = _rl_rows()
    indices = [4, 0, 2, 3]
    shares = [pack_micro_batch(batch, indices, cp_rank=r, cp_size=cp, tp_size=tp) for r in range(cp)]
    cu, cu_padded = shares[0]["cu_seqlens"], shares[0]["cu_seqlens_padded"]
    lengths = batch["lengths"][indices]
    assert cu.tolist() == [0] + lengths.cumsum(0).tolist()
    seq_lengths = (cu_padded[1:] - cu_padded[:-1])
    assert bool((seq_lengths[:-1] % (2 * cp if cp > 1 else 1) == 0).all())
    assert int(cu_padded[-1]) % ((2 * cp if cp > 1 else 1) * tp) == 0
    for key in ("tokens", "labels", "response_mask", "rollout_log_probs"):
        full = zigzag_unsplit([s[key][0] for s in shares], dim=0, cu_seqlens_padded=cu_padded)
        for j, i in enumerate(indices):
            start, n = int(cu_padded[j]), int(lengths[j])
            assert torch.equal(full[start:start + n], batch[key][i, :n]), key
            assert not full[start + n:int(cu_padded[j + 1])].bool().any(), f"{key}: padding"
    positions = zigzag_unsplit([s["position_ids"][0] for s in shares], dim=0,
                               cu_seqlens_padded=cu_padded)
    for j in range(len(indices)):  # RoPE positions restart at every sequence
        assert positions[int(cu_padded[j]):int(cu_padded[j + 1])].tolist() == list(
            range(int(seq_lengths[j])))
    assert torch.equal(shares[0]["advantages"], batch["advantages"][indices])
    # the loss's rows: per sequence, the response tokens over all CP ranks are those of the row
    counts = sum(response_counts(s) for s in shares)
    assert counts.tolist() == batch["response_mask"][indices].sum(-1).tolist()
    for j, i in enumerate(indices):
        got = sorted(float(v) for s in shares
                     for v, m in zip(loss_rows(s, s["rollout_log_probs"])[j],
                                     loss_rows(s, s["response_mask"], fill_value=False)[j]) if m)
        want = sorted(float(v) for v in batch["rollout_log_probs"][i][batch["response_mask"][i]])
        assert got == want


def test_empty_pack_is_padding_only():
    batch = _rl_rows()
    mb = pack_micro_batch(batch, [], cp_rank=1, cp_size=2, tp_size=2)
    assert mb["cu_seqlens_padded"].tolist() == [0, 8]
    assert mb["tokens"].shape == (1, 4)
    assert not mb["response_mask"].any()
    assert response_counts(mb).tolist() == [0]


def test_packed_micro_batches_cover_the_batch_once_over_dp_ranks():
    batch = _rl_rows()
    seen = []
    per_rank = [packed_micro_batches(batch, 32, dp_rank=r, dp_size=2) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1])
    for mbs in per_rank:
        for mb in mbs:
            assert mb["tokens"].shape[1] <= 32
            seen += mb["advantages"].tolist()
    assert sorted(seen) == sorted(batch["advantages"].tolist())


@pytest.mark.parametrize("cp,tp", [(2, 1), (2, 2)])
def test_zigzag_rows_reassemble(cp, tp):
    batch = _rl_rows()
    shares = [split_rows_for_context_parallel(batch, r, cp, tp) for r in range(cp)]
    target = shares[0]["tokens"].shape[1] * cp
    assert target % (2 * cp * tp) == 0 and target >= batch["tokens"].shape[1]
    for key in ("tokens", "response_mask", "rollout_log_probs"):
        full = zigzag_unsplit([s[key] for s in shares], dim=1)
        assert torch.equal(full[:, :batch[key].shape[1]], batch[key])
        assert not full[:, batch[key].shape[1]:].bool().any()
    positions = zigzag_unsplit([s["position_ids"] for s in shares], dim=1)
    assert torch.equal(positions, torch.arange(target).expand_as(positions))
    assert torch.equal(shares[1]["advantages"], batch["advantages"])


def test_logit_index_selects_the_response_positions():
    mb = pack_micro_batch(_rl_rows(), [0, 2])
    add_logit_index(mb)
    flat = mb["response_mask"].reshape(-1)
    assert mb["logit_index"].tolist() == [i for i, m in enumerate(flat.tolist()) if m]


def test_config_fields_of_packing_and_context_parallelism():
    from megatron_gspo.config import ConfigError, config_from_dict, validate_sft_context_parallel

    cfg = config_from_dict({"parallel": {"context": 2, "cp_comm_type": "all_gather"},
                            "run": {"max_tokens_per_micro_batch": 4096}})
    assert (cfg.parallel.context, cfg.run.max_tokens_per_micro_batch) == (2, 4096)
    with pytest.raises(ConfigError, match=r"run\.max_tokens_per_micro_batch: must be >= 1"):
        config_from_dict({"run": {"max_tokens_per_micro_batch": 0}})
    with pytest.raises(ConfigError, match=r"parallel\.cp_comm_type"):
        config_from_dict({"parallel": {"cp_comm_type": "ring"}})
    with pytest.raises(ConfigError, match=r"parallel\.context: 2: SFT does not split"):
        validate_sft_context_parallel(cfg.parallel)
    validate_sft_context_parallel(config_from_dict({}).parallel)
