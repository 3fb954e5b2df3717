"""Routing replay (``gspo.routing_replay``) on Megatron-Core's RouterReplay.

1. The model (one process): replaying the experts the routers chose gives bit-equal logits and
   log-probs (fp32), also when the experts come in through the batch layout
   (``routed_experts [b, s, layers, k]`` -> ``MoERouting.targets_from_batch``). After a change of
   one layer's router weights, the replayed gates differ from the recomputed ones exactly at the
   (token, layer) pairs where the two top-k expert SETS differ: the change is in the last layer
   (layer 1), whose input is then the same in both forwards, or in layer 0, compared there.
2. The trainer (spawned gloo ranks): ``train_rollout`` with replay ``old`` and ``rollout`` under
   EP2 and TP2xEP2 (sequence parallel: the replay tensors are cut into SP slices), PP2 (only the
   local layers) and CP2 with packed micro-batches (zigzag shares of packed sequences) gives the
   single-process replayed run's reduced metrics (loss, clip fractions, routing metrics) and
   updated weights within 1e-5; each replay mode changes the update compared with ``none``, so
   the replay is not a no-op.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.hf.mapping import hf_param_shapes
from tests.distributed import rl_trainer_worker, routing_worker
from tests.distributed.layouts import LAYOUTS, assemble, max_rel_diff, tiny_config
from bench.spawn import run_on_ranks
from tests.distributed.test_rl_trainer_layouts import SCALE_FLOOR, TIMING, TOLERANCE

SEQ = 16
NUM_LAYERS, TOPK, NUM_EXPERTS = 2, 2, 4  # tests.distributed.layouts.TINY_MODEL


def model_batch(rows: int = 4, seed: int = 3) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 250, (rows, SEQ + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(SEQ).expand(rows, SEQ).contiguous()}


def _set_changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Reference: per row, whether the python sets of the two rows differ."""
    return torch.tensor([set(x.tolist()) != set(y.tolist()) for x, y in zip(a, b)])


@pytest.fixture(scope="module", params=[1, 0], ids=["change_layer1", "change_layer0"])
def model_runs(request):
    cfg = tiny_config({}, run={"seed": 2})
    return request.param, run_on_ranks(1, routing_worker.run_replay_equivalence,
                                       (cfg, model_batch(), request.param, 0.05),
                                       timeout_s=300)[0]


def test_replay_of_unchanged_routing_is_bit_equal(model_runs):
    _, r = model_runs
    for name in ("replayed", "from_batch"):
        assert torch.equal(r[name]["logits"], r["free"]["logits"]), name
        assert torch.equal(r[name]["log_probs"], r["free"]["log_probs"]), name
        for layer in range(NUM_LAYERS):
            assert torch.equal(r[name]["gates"][layer], r["free"]["gates"][layer]), (name, layer)
            assert torch.equal(r[name]["topk"][layer], r["free"]["topk"][layer]), (name, layer)


def test_replayed_gates_differ_exactly_where_expert_sets_differ(model_runs):
    perturbed, r = model_runs
    free, replayed, old = r["changed_free"], r["changed_replayed"], r["free"]
    checked = [0, 1] if perturbed == 1 else [0]  # layers whose input is the same in both forwards
    for layer in range(NUM_LAYERS):
        if layer < perturbed:  # before the change: routing as before, in both forwards
            assert torch.equal(free["gates"][layer], old["gates"][layer])
    for layer in checked:
        differs = _set_changed(old["topk"][layer], free["topk"][layer])
        if layer != perturbed:
            assert not differs.any()
            assert torch.equal(replayed["gates"][layer], free["gates"][layer])
            continue
        assert 0 < int(differs.sum()) < len(differs), f"layer {layer}: {int(differs.sum())} changed"
        gap = (replayed["gates"][layer] - free["gates"][layer]).abs().amax(dim=-1)
        # same set: the same k scores (order aside) -> the same gates up to fp32 rounding;
        # another set: an expert's gate moves from > 0 to 0
        assert float(gap[~differs].max()) <= 1e-6
        assert float(gap[differs].min()) > 1e-3
        # the replayed forward used the OLD experts, the free one its own
        used = replayed["gates"][layer] > 0
        assert torch.equal(used, torch.zeros_like(used).scatter(1, old["topk"][layer], True))
    if perturbed == 1:
        assert not torch.equal(replayed["logits"], free["logits"])


# ----------------------------------------------------------------------------------------------
# The trainer under parallel layouts

GSPO = {"variant": "grpo", "token_eps_low": 2e-3, "token_eps_high": 2e-3,
        "updates_per_rollout": 2, "old_logprobs": "recompute", "mismatch_correction": False}
RUN = {"seed": 7, "micro_batch_size": 2, "global_batch_size": 8, "seq_length": SEQ}
STEP = 1
RESPONSE_LENGTHS = [1, 11, 5, 8, 3, 12, 7, 9]


def rollout_batch(seed: int = 13, vocab: int = 250) -> dict:
    """8 sampled responses (``batching.rl_batch`` layout) and the rollout servers' experts: a
    random top-k set per (token, layer), -1 after each sequence (padding)."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(RESPONSE_LENGTHS)
    tokens = torch.randint(0, vocab, (rows, SEQ + 1), generator=gen)
    prompt_len = torch.randint(2, 5, (rows,), generator=gen)
    response_len = torch.tensor(RESPONSE_LENGTHS)
    lengths = (prompt_len + response_len - 1).clamp(max=SEQ)
    positions = torch.arange(SEQ).expand(rows, SEQ)
    response_mask = (positions >= prompt_len[:, None] - 1) & (positions < lengths[:, None])
    experts = torch.rand(rows, SEQ, NUM_LAYERS, NUM_EXPERTS, generator=gen).argsort(-1)[..., :TOPK]
    experts = torch.where((positions < lengths[:, None])[..., None, None], experts, -1)
    rollout = -5.5 + 0.3 * torch.randn(rows, SEQ, generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": positions.contiguous(), "response_mask": response_mask,
            "rollout_log_probs": torch.where(response_mask, rollout, 0.0),
            "advantages": torch.randn(rows, generator=gen), "lengths": lengths,
            "routed_experts": experts}


def _run(world: int, parallel: dict, replays: tuple, budget=None, scatter=False) -> dict:
    """One spawn: ``train_rollout`` of the batch with each routing replay mode in ``replays``
    (``scatter``: each rank receives only its rows of rank 0's routed experts first)."""
    cfgs = [tiny_config(parallel, gspo={**GSPO, "routing_replay": replay},
                        run={**RUN, "max_tokens_per_micro_batch": budget}) for replay in replays]
    per_rank = run_on_ranks(world, rl_trainer_worker.run_train_rollouts,
                            (cfgs, rollout_batch(), STEP, scatter), timeout_s=300)
    shapes = hf_param_shapes(config_from_dict(cfgs[0]).model)
    out = {}
    for i, replay in enumerate(replays):
        results = [r[i] for r in per_rank]
        out[replay] = {"metrics": results[0]["metrics"],
                       "weights": assemble(results, "weights", shapes),
                       "received": [r["received"] for r in results]}
    return out


@pytest.fixture(scope="module")
def references():
    return _run(1, {}, ("none", "old", "rollout"))


def _compare(run: dict, ref: dict, what: str) -> None:
    assert run["metrics"].keys() == ref["metrics"].keys()
    bad = {k: (run["metrics"][k], v) for k, v in ref["metrics"].items() if k not in TIMING
           and abs(run["metrics"][k] - v) > TOLERANCE * max(abs(v), SCALE_FLOOR)}
    assert not bad, f"{what}: reduced metrics differ from the single-process run: {bad}"
    bad = {n: max_rel_diff(run["weights"][n], ref["weights"][n]) for n in ref["weights"]
           if max_rel_diff(run["weights"][n], ref["weights"][n]) > TOLERANCE}
    assert not bad, f"{what}: updated weights differ from the single-process run: {bad}"


def test_replay_changes_the_update(references):
    none = references["none"]
    assert 0 < none["metrics"]["routing_change_frac"] < 1
    for replay in ("old", "rollout"):
        moved = max(max_rel_diff(references[replay]["weights"][n], none["weights"][n])
                    for n in none["weights"])
        assert moved > 1e-3, f"routing_replay {replay}: the update equals the one without replay"
    # the old-policy forward replays the rollout's random experts: another log pi_old (the
    # untrained policy is near uniform, so the shift is small, but far above fp32 rounding)
    key = "rollout_trainer_logprob_abs_diff"
    assert abs(references["rollout"]["metrics"][key] - none["metrics"][key]) > 1e-4


@pytest.mark.parametrize("layout", ["EP2", "TP2xEP2"])
def test_replay_under_expert_and_tensor_parallelism(layout, references):
    world, parallel = LAYOUTS[layout]
    for replay, run in _run(world, parallel, ("old", "rollout")).items():
        _compare(run, references[replay], f"{layout} {replay}")


@pytest.mark.parametrize("name,world,parallel,budget", [
    ("PP2", 2, {"pipeline": 2}, None),
    ("CP2packed", 2, {"context": 2}, 16),
])
def test_rollout_replay_under_pipeline_and_packed_context_parallelism(name, world, parallel,
                                                                      budget, references):
    _compare(_run(world, parallel, ("rollout",), budget)["rollout"], references["rollout"], name)


@pytest.mark.parametrize("budget", [None, 16], ids=["padded", "packed"])
def test_each_rank_receives_only_the_routed_experts_of_its_own_rows(budget, references):
    # the loop keeps the routed experts out of the batch's broadcast and scatters them: under DP2
    # each rank gets the rows of its own micro-batches (4 of 8 padded; the packing plan's share
    # packed), their values exactly, and trains to the single-process result
    run = _run(2, {}, ("rollout",), budget, scatter=True)["rollout"]
    _compare(run, references["rollout"], f"DP2 scattered {budget}")
    full = rollout_batch()["routed_experts"].to(torch.int16)
    got = [set(rows) for rows, _ in run["received"]]
    assert not got[0] & got[1] and got[0] | got[1] == set(range(len(RESPONSE_LENGTHS)))
    if budget is None:
        assert [len(rows) for rows in got] == [4, 4]
    for rows, experts in run["received"]:
        assert rows == sorted(rows) and torch.equal(experts, full[rows])
