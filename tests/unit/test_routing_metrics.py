"""The routing-volatility and log-ratio-variance metrics (``train.routing_metrics``), their
pooling over micro-batches (``metric_reduction``), the replay accommodation
(``model.routing_replay.CapturingRouterReplay``), ``routed_experts`` through the batch layouts,
and the checks of ``gspo.routing_replay``; against independent references (python sets, float64
statistics over the whole batch), on hand-built top-k tensors."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch

from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.loss.context_parallel import zigzag_unsplit
from megatron_gspo.train.batching import pack_micro_batch, split_rows_for_context_parallel
from megatron_gspo.train.metric_reduction import combine_metrics
from megatron_gspo.train.routing_metrics import (expert_set_changed, log_ratio_stats,
                                                 routing_change_metrics)


class _Group:
    def __init__(self, size=1, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


PG = SimpleNamespace(pp=_Group(), tp=_Group(), cp=_Group(), dp=_Group())


def _routing(layers):
    from megatron_gspo.model.routing_replay import MoERouting

    routing = MoERouting.__new__(MoERouting)  # the layout helpers, without a model
    routing.layers, routing.sequence_parallel, routing.tp = list(layers), False, _Group()
    return routing


def _to_router(x_BS):  # independent of MoERouting.router_layout: token n = t * b + row
    b, s = x_BS.shape[:2]
    return torch.stack([x_BS[n % b, n // b] for n in range(b * s)])


def test_expert_set_changed_is_a_set_comparison():
    old = torch.tensor([[0, 1], [2, 3], [1, 0], [5, 6], [7, 2]])
    new = torch.tensor([[1, 0], [2, 4], [0, 1], [6, 5], [2, 3]])
    expected = [set(a.tolist()) != set(b.tolist()) for a, b in zip(old, new)]
    assert expert_set_changed(old, new).tolist() == expected == [False, True, False, False, True]


def _hand_built(seed, rows, seq, num_layers=3, topk=2, experts=6):
    gen = torch.Generator().manual_seed(seed)
    old = torch.rand(rows, seq, num_layers, experts, generator=gen).argsort(-1)[..., :topk]
    new = old.clone()
    flip = torch.rand(rows, seq, num_layers, generator=gen) < 0.3
    shuffled = torch.rand(rows, seq, num_layers, experts, generator=gen).argsort(-1)[..., :topk]
    new[flip] = shuffled[flip]
    new = new.flip(-1)  # the order within a row never counts
    mask = torch.rand(rows, seq, generator=gen) < 0.6
    return old, new, mask


def test_routing_change_metrics_match_a_reference_over_the_whole_batch():
    num_layers = 3
    batches = [_hand_built(1, 2, 7, num_layers), _hand_built(2, 3, 4, num_layers)]
    routing = _routing(range(num_layers))
    microbatches = []
    for old, new, mask in batches:
        microbatches.append({
            "response_mask": mask,
            "routing_old": [_to_router(old[:, :, layer]) for layer in range(num_layers)],
            "routing_new": [_to_router(new[:, :, layer]) for layer in range(num_layers)]})
    reduced = combine_metrics(routing_change_metrics(microbatches, routing, PG, num_layers))
    pairs, per_layer, any_layer, tokens = 0, [0] * num_layers, 0, 0
    for old, new, mask in batches:
        for row, pos in mask.nonzero().tolist():
            tokens += 1
            changes = [set(old[row, pos, layer].tolist()) != set(new[row, pos, layer].tolist())
                       for layer in range(num_layers)]
            pairs += sum(changes)
            any_layer += any(changes)
            for layer, changed in enumerate(changes):
                per_layer[layer] += changed
    assert reduced["num_tokens"] == tokens
    assert 0 < pairs < tokens * num_layers
    assert reduced["routing_change_frac"] == pytest.approx(pairs / (tokens * num_layers), abs=1e-15)
    assert reduced["routing_change_any_frac"] == pytest.approx(any_layer / tokens, abs=1e-15)
    for layer in range(num_layers):
        assert reduced[f"routing_change_frac_layer{layer}"] == pytest.approx(
            per_layer[layer] / tokens, abs=1e-15)


def test_log_ratio_variances_pool_all_tokens_and_sequences():
    """Padded and packed micro-batches of different sizes: the reduced variances are those of
    all response tokens / all sequences of the batch (population variances, float64)."""
    gen = torch.Generator().manual_seed(4)
    token_values, seq_values, per_mb = [], [], []
    # padded rows [3, 6]
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    old = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    new = old + 0.1 * torch.randn(3, 6, generator=gen, dtype=torch.float64)
    per_mb.append(log_ratio_stats({"response_mask": mask, "old_log_probs": old}, new, None))
    for row in range(3):
        values = (new - old)[row][mask[row]].tolist()
        token_values += values
        if values:
            seq_values.append(sum(values) / len(values))
    # a packed row of two sequences of 4 and 3 tokens
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    old = torch.randn(1, 7, generator=gen, dtype=torch.float64)
    new = old + 0.3 * torch.randn(1, 7, generator=gen, dtype=torch.float64) + 0.2
    mb = {"response_mask": mask, "old_log_probs": old, "cu_seqlens_local": cu}
    per_mb.append(log_ratio_stats(mb, new, None))
    for start, end in ((0, 4), (4, 7)):
        values = (new - old)[0, start:end][mask[0, start:end]].tolist()
        token_values += values
        seq_values.append(sum(values) / len(values))
    reduced = combine_metrics(per_mb)
    assert reduced["num_tokens"] == len(token_values) and reduced["num_sequences"] == len(seq_values)
    assert reduced["token_log_ratio_mean"] == pytest.approx(statistics.fmean(token_values), abs=1e-12)
    assert reduced["token_log_ratio_var"] == pytest.approx(statistics.pvariance(token_values), abs=1e-12)
    assert reduced["seq_log_ratio_mean"] == pytest.approx(statistics.fmean(seq_values), abs=1e-12)
    assert reduced["seq_log_ratio_var"] == pytest.approx(statistics.pvariance(seq_values), abs=1e-12)
    # the mean of the micro-batches' variances is a different number on this batch
    mean_of_vars = sum(m["token_log_ratio_var"] for m in per_mb) / len(per_mb)
    assert abs(mean_of_vars - reduced["token_log_ratio_var"]) > 1e-3


def test_capturing_replay_uses_the_router_for_unknown_rows():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from megatron_gspo.model.routing_replay import CapturingRouterReplay

    before = len(RouterReplay.global_router_replay_instances)
    replay = CapturingRouterReplay()
    assert len(RouterReplay.global_router_replay_instances) == before  # not in the global list
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.1, 0.2, 0.7], [0.2, 0.3, 0.4, 0.1]])
    target = torch.tensor([[0, 3], [-1, -1], [2, 1]])
    replay.set_target_indices(target)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, indices = replay.get_replay_topk(
        scores, 2, default_compute_topk=lambda s, k, num_groups=None, group_topk=None:
        torch.topk(s, k=k, dim=1))
    assert indices.tolist() == [[0, 3], [0, 3], [2, 1]]  # row 1: the router's own top-2
    assert torch.equal(probs, scores.gather(1, indices))
    assert replay.computed.tolist() == [[1, 2], [0, 3], [2, 1]]  # its own choice, always kept


def _encoded_batch(rows=3, seq=7, layers=2, topk=2):
    tokens = torch.arange(1, rows * seq + 1).reshape(rows, seq)  # > 0: padding is 0
    lengths = torch.tensor([5, 7, 3])
    routed = tokens[..., None, None] * 10 + torch.arange(layers)[:, None] * 2 + torch.arange(topk)
    routed = torch.where((torch.arange(seq) < lengths[:, None])[..., None, None], routed, -1)
    tokens = torch.where(torch.arange(seq) < lengths[:, None], tokens, 0)
    return {"tokens": tokens, "labels": tokens.clone(), "response_mask": tokens > 0,
            "lengths": lengths, "routed_experts": routed}


def _check_follows_tokens(tokens, routed, layers=2, topk=2):
    real = tokens > 0
    expected = tokens[..., None, None] * 10 + torch.arange(layers)[:, None] * 2 + torch.arange(topk)
    assert torch.equal(routed[real], expected[real])
    assert bool((routed[~real] == -1).all())


@pytest.mark.parametrize("cp", [1, 2])
def test_routed_experts_follow_the_tokens_when_packed(cp):
    batch = _encoded_batch()
    parts = [pack_micro_batch(batch, [2, 0], cp_rank=r, cp_size=cp, tp_size=2) for r in range(cp)]
    for part in parts:
        assert part["routed_experts"].shape[:2] == part["tokens"].shape
        assert part["routed_experts"].shape[2:] == (2, 2)
        _check_follows_tokens(part["tokens"], part["routed_experts"])
    whole = zigzag_unsplit([p["routed_experts"][0] for p in parts], dim=0,
                           cu_seqlens_padded=parts[0]["cu_seqlens_padded"])
    assert int((whole[..., 0, 0] >= 0).sum()) == 3 + 5  # every real token once


def test_routed_experts_follow_the_tokens_in_context_parallel_rows():
    batch = _encoded_batch()
    for rank in range(2):
        part = split_rows_for_context_parallel(batch, rank, 2, tp_size=2)
        assert part["routed_experts"].shape == (3, 4, 2, 2)  # 7 -> 8 positions, half per rank
        _check_follows_tokens(part["tokens"], part["routed_experts"])


def test_validate_routed_experts_names_the_problem():
    from megatron_gspo.train.batching import validate_routed_experts

    batch = {"tokens": torch.zeros(2, 3, dtype=torch.long)}
    with pytest.raises(ValueError, match="is missing"):
        validate_routed_experts(batch, 2, 2, 4)
    good = torch.tensor([0, 1]).expand(2, 3, 2, 2).clone()
    validate_routed_experts({**batch, "routed_experts": good}, 2, 2, 4)
    with pytest.raises(ValueError, match=r"shape \(2, 3, 2, 2\), expected \(2, 3, 3, 2\)"):
        validate_routed_experts({**batch, "routed_experts": good}, 3, 2, 4)
    with pytest.raises(ValueError, match="outside"):
        validate_routed_experts({**batch, "routed_experts": good + 3}, 2, 2, 4)
    with pytest.raises(ValueError, match="integer"):
        validate_routed_experts({**batch, "routed_experts": good.float()}, 2, 2, 4)
    twice = good.clone()
    twice[1, 2, 0] = torch.tensor([3, 3])
    with pytest.raises(ValueError, match="row 1, position 2, layer 0 names an expert twice"):
        validate_routed_experts({**batch, "routed_experts": twice}, 2, 2, 4)
    unknown = good.clone()
    unknown[0, 1] = -1  # -1 twice: unknown, not a duplicate
    validate_routed_experts({**batch, "routed_experts": unknown}, 2, 2, 4)


def test_routing_replay_config_checks():
    assert config_from_dict({}).gspo.routing_replay == "none"
    assert config_from_dict({"gspo": {"routing_replay": "old"}}).gspo.routing_replay == "old"
    with pytest.raises(ConfigError, match="gspo.routing_replay"):
        config_from_dict({"gspo": {"routing_replay": "yes"}})
    with pytest.raises(ConfigError, match="gspo.routing_replay: rollout is not supported with "
                                          "activation recompute"):
        config_from_dict({"gspo": {"routing_replay": "rollout"},
                          "model": {"recompute_granularity": "selective",
                                    "recompute_modules": ["moe"]}})
    config_from_dict({"gspo": {"routing_replay": "old"},
                      "model": {"recompute_granularity": "selective",
                                "recompute_modules": ["core_attn"]}})
