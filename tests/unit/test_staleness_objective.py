"""GSPO under staleness: the decoupled and the bypass objective against an independent float64 loop.

docs/gspo_math.md, "The objective under staleness". Three log-probs per token: ``lp`` (pi_theta,
trained), ``prox`` (the proximal policy, the trainer's weights at the start of the update,
recomputed) and ``beh`` (the behaviour policy: the log-prob the rollout recorded for the token,
from the weights that sampled it; the tokens of one sequence come from up to three versions here).

    decoupled (gspo.old_logprobs: recompute)  s_i = exp(mean_t(lp - prox)), clipped;
                                              m_i = sg[min(exp(mean_t(prox - beh)), C)]
    bypass    (gspo.old_logprobs: rollout)    s_i = exp(mean_t(lp - beh)), clipped; m_i = 1
    loss = -(1/D) sum_{i: n_i > 0} m_i min(s_i A_i, clip(s_i) A_i)

The reference below is plain Python on lists of floats and shares no code with the project. The
code under test is reached the way the trainer reaches it: ``GSPOConfig`` -> ``rl_trainer
.ratio_log_probs`` (what pi_old is) -> ``rl_loss.make_gspo_loss_fn`` -> ``gspo_loss``, with the
policy's log-probs injected in place of Megatron's logits, and the trainer's own micro-batch
layouts (``batching``) for the context-parallel checks.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_gspo.config import ConfigError, GSPOConfig, config_from_dict
from megatron_gspo.loss.gspo import gspo_loss
from megatron_gspo.train import batching
from megatron_gspo.train.metric_reduction import combine_metrics
from megatron_gspo.train.rl_trainer import ratio_log_probs

EPS_LOW, EPS_HIGH = 0.04, 0.05  # wide enough for cuts on both sides and uncut sequences
CAP = 2.0
ROWS, LENGTH = 24, 12
GROUP_SIZE = 4


# ---------------------------------------------------------------------------------------------
# The independent reference
# ---------------------------------------------------------------------------------------------


def reference(form, lp, prox, beh, adv, mask, *, eps_low=EPS_LOW, eps_high=EPS_HIGH, cap=CAP, denominator=None):
    """``(loss, grad, rows)``: the loss, d loss / d lp (analytic), one dict per row with ``n``,
    ``weight``, ``truncated``, ``cut`` ("low" / "high" / "") and ``log_s``."""
    rows, total, count = [], 0.0, 0
    grad = [[0.0] * len(row) for row in lp]
    for i in range(len(lp)):
        tokens = [t for t in range(len(lp[i])) if mask[i][t]]
        n = len(tokens)
        row = {"n": n, "weight": 1.0, "truncated": False, "cut": "", "log_s": 0.0}
        rows.append(row)
        if n == 0:
            continue
        count += 1
        anchor = prox if form == "decoupled" else beh
        log_s = sum(lp[i][t] - anchor[i][t] for t in tokens) / n
        s = math.exp(log_s)
        if form == "decoupled":
            raw = math.exp(sum(prox[i][t] - beh[i][t] for t in tokens) / n)
            row["weight"], row["truncated"] = min(raw, cap), raw > cap
        clipped = min(max(s, 1.0 - eps_low), 1.0 + eps_high)
        unclipped_value, clipped_value = s * adv[i], clipped * adv[i]
        objective = min(unclipped_value, clipped_value)
        flows = unclipped_value <= clipped_value
        if not flows:
            row["cut"] = "low" if s < 1.0 - eps_low else "high"
        row["log_s"], row["objective"] = log_s, objective
        total += row["weight"] * objective
        row["d_objective"] = row["weight"] * s * adv[i] / n if flows else 0.0
    d = count if denominator is None else denominator
    for i, row in enumerate(rows):
        for t in range(len(lp[i])):
            if row["n"] and mask[i][t]:
                grad[i][t] = -row["d_objective"] / d
    return -total / d, grad, rows


def reference_metrics(rows):
    kept = [row for row in rows if row["n"] > 0]
    weights = [row["weight"] for row in kept]
    n = len(kept)
    return {
        "num_sequences": n,
        "mismatch_weight_mean": sum(weights) / n,
        "mismatch_weight_max": max(weights),
        "mismatch_weight_ess": sum(weights) ** 2 / (n * sum(w * w for w in weights)),
        "mismatch_capped_frac": sum(row["truncated"] for row in kept) / n,
        "clip_frac_low": sum(row["cut"] == "low" for row in kept) / n,
        "clip_frac_high": sum(row["cut"] == "high" for row in kept) / n,
        "clip_frac": sum(row["cut"] != "" for row in kept) / n,
    }


# ---------------------------------------------------------------------------------------------
# A stale batch: sequences whose tokens come from several weight versions
# ---------------------------------------------------------------------------------------------


def stale_batch(seed: int = 0, *, rows: int = ROWS, length: int = LENGTH) -> dict:
    """Float64 lists (the reference's input) and the matching tensors.

    Row 0 is padding, row 1 one token, row 2 the full length. Each sequence's response is cut into
    1 to 3 segments, segment j sampled ``versions - j`` versions before the proximal policy: its
    behaviour log-probs differ from ``prox`` by a per-version offset (older: larger) plus noise.
    Rows 3 and 9 are very stale (mean prox - beh about 1.0 > ln 2: truncated). Rows 4..7 are a
    zero-std group (A = 0). Outside the mask every log-prob is -inf or NaN.
    """
    rng = random.Random(seed)
    lengths = [rng.randint(2, length) for _ in range(rows)]
    lengths[0], lengths[1], lengths[2] = 0, 1, length
    mask = [[False] * length for _ in range(rows)]
    prox = [[-rng.uniform(0.05, 3.0) for _ in range(length)] for _ in range(rows)]
    beh = [[0.0] * length for _ in range(rows)]
    lp = [[0.0] * length for _ in range(rows)]
    versions_of_row = []
    for i, n in enumerate(lengths):
        start = rng.randint(0, length - n)
        tokens = list(range(start, start + n))
        for t in tokens:
            mask[i][t] = True
        versions = rng.randint(1, min(3, max(n, 1)))
        cuts = sorted(rng.sample(range(1, n), versions - 1)) if n > 1 else []
        per_version = rng.uniform(-0.2, 0.2)
        very_stale = 1.0 if i in (3, 9) else 0.0
        version_of_token = {}
        for j, (a, b) in enumerate(zip([0] + cuts, cuts + [n])):
            for k in range(a, b):
                version_of_token[tokens[k]] = versions - j  # versions behind the proximal policy
        versions_of_row.append(sorted(set(version_of_token.values())))
        shift = rng.uniform(-0.12, 0.12)
        for t in range(length):
            if t in version_of_token:
                lag = version_of_token[t]
                beh[i][t] = prox[i][t] - very_stale - per_version * lag / versions + rng.gauss(0.0, 0.05)
                lp[i][t] = prox[i][t] + shift + rng.gauss(0.0, 0.06)
            else:
                lp[i][t], prox[i][t], beh[i][t] = -math.inf, -math.inf, math.nan
    rewards = [rng.gauss(0.0, 1.0) for _ in range(rows)]
    rewards[4:8] = [1.0] * 4
    adv = []
    for g in range(0, rows, GROUP_SIZE):
        group = rewards[g:g + GROUP_SIZE]
        mean = sum(group) / GROUP_SIZE
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / GROUP_SIZE)
        adv += [0.0 if max(group) == min(group) else (r - mean) / (std + 1e-6) for r in group]
    t64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    return {"lists": dict(lp=lp, prox=prox, beh=beh, adv=adv, mask=mask), "versions": versions_of_row,
            "log_probs": t64(lp), "proximal_log_probs": t64(prox), "rollout_log_probs": t64(beh),
            "advantages": t64(adv), "response_mask": torch.tensor(mask)}


# ---------------------------------------------------------------------------------------------
# The code under test, reached as the trainer reaches it
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def injected_log_probs(monkeypatch):
    """``micro_batch_log_probs`` returns the micro-batch's ``policy_log_probs`` (a leaf with
    gradient) instead of computing them from logits: the rest of the loss function is the real one."""
    import megatron_gspo.model.gpt as gpt

    def fake(logits, mb, model, pg, *, temperature=1.0, with_entropy=False):
        return mb["policy_log_probs"], None

    monkeypatch.setattr(gpt, "micro_batch_log_probs", fake)


def micro_batch(data: dict, cfg: GSPOConfig) -> dict:
    """A padded-rows micro-batch as the trainer's loss sees it: pi_old per ``ratio_log_probs``."""
    mb = {"response_mask": data["response_mask"], "advantages": data["advantages"],
          "rollout_log_probs": data["rollout_log_probs"]}
    mb["old_log_probs"] = ratio_log_probs(cfg, data["proximal_log_probs"], mb)
    return mb


def run(cfg: GSPOConfig, mb: dict, log_probs: torch.Tensor, sequence_reduce=None):
    """``(loss sum over sequences, d loss / d log_probs, metrics)`` of ``make_gspo_loss_fn``."""
    from megatron_gspo.train.rl_loss import make_gspo_loss_fn

    leaf = log_probs.detach().clone().requires_grad_()
    loss_fn = make_gspo_loss_fn(None, cfg, None, sequence_reduce=sequence_reduce)
    loss, metrics = loss_fn(None, {**mb, "policy_log_probs": leaf})
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


def config(form: str, **fields) -> GSPOConfig:
    return GSPOConfig(old_logprobs="recompute" if form == "decoupled" else "rollout",
                      eps_low=EPS_LOW, eps_high=EPS_HIGH, mismatch_cap=CAP, **fields)


FORMS = ("decoupled", "bypass")


# ---------------------------------------------------------------------------------------------
# Values, gradients, metrics against the reference
# ---------------------------------------------------------------------------------------------


def assert_stale_in_the_intended_ways(data: dict, form: str) -> None:
    """Several versions per sequence, truncated and untruncated weights, every branch of the cut."""
    assert any(len(v) == 3 for v in data["versions"]) and any(len(v) == 2 for v in data["versions"])
    _, _, rows = reference("decoupled", **data["lists"])
    assert 2 <= sum(row["truncated"] for row in rows) < sum(row["n"] > 0 for row in rows) - 2
    _, _, rows = reference(form, **data["lists"])
    sides = [row["cut"] for row in rows if row["n"]]
    assert {"low", "high", ""} <= set(sides), form
    # A < 0 with s above the range: not cut, the full gradient (the pessimistic branch)
    assert any(row["n"] and data["lists"]["adv"][i] < 0 and row["log_s"] > math.log(1 + EPS_HIGH)
               and row["cut"] == "" for i, row in enumerate(rows)), form


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("form", FORMS)
def test_value_gradient_and_metrics_match_the_reference(form, seed, injected_log_probs):
    data = stale_batch(seed)
    assert_stale_in_the_intended_ways(data, form)
    cfg = config(form)
    loss, grad, metrics = run(cfg, micro_batch(data, cfg), data["log_probs"])
    expected_loss, expected_grad, rows = reference(form, **data["lists"], denominator=1.0)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(expected_loss, abs=1e-12)
    torch.testing.assert_close(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-11, atol=1e-13)
    mask = data["response_mask"]
    assert torch.isfinite(grad).all() and torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    assert grad[4:8].abs().sum() == 0  # A = 0: no gradient

    expected = reference_metrics(rows)
    if form == "bypass":  # no weight at all: nothing to report about it
        assert not any(name.startswith("mismatch_") for name in metrics)
        expected = {k: v for k, v in expected.items() if not k.startswith("mismatch_")}
    else:
        assert 0 < expected["mismatch_capped_frac"] < 1 and expected["mismatch_weight_max"] == CAP
        assert 1 / expected["num_sequences"] < expected["mismatch_weight_ess"] < 1
    for name, value in expected.items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-12), name
    assert metrics["clip_frac"].item() > 0


@pytest.mark.parametrize("form", FORMS)
def test_the_reference_gradient_is_the_finite_difference_of_the_reference_loss(form):
    """The reference's analytic gradient checked on its own loss (central differences, float64)."""
    data = stale_batch(3, rows=12, length=7)
    lists = data["lists"]
    _, grad, rows = reference(form, **lists)
    assert sum(row["cut"] == "" for row in rows if row["n"]) >= 3 and any(row["cut"] for row in rows)
    h = 1e-6
    for i, row in enumerate(lists["lp"]):
        for t in range(len(row)):
            if not lists["mask"][i][t]:
                continue
            values = []
            for sign in (1, -1):
                lp = [list(r) for r in lists["lp"]]
                lp[i][t] += sign * h
                values.append(reference(form, **{**lists, "lp": lp})[0])
            assert (values[0] - values[1]) / (2 * h) == pytest.approx(grad[i][t], abs=1e-8), (i, t)


def test_truncated_sequences_weigh_exactly_the_cap(injected_log_probs):
    """A very stale sequence alone: m_i = C, its gradient C times the unweighted one."""
    data = stale_batch()
    only = torch.zeros_like(data["response_mask"])
    only[3] = data["response_mask"][3]
    data = {**data, "response_mask": only}
    cfg = config("decoupled")
    _, grad, metrics = run(cfg, micro_batch(data, cfg), data["log_probs"])
    _, grad_unweighted, _ = run(config("decoupled", mismatch_correction=False), micro_batch(data, cfg),
                                data["log_probs"])
    assert metrics["mismatch_weight_mean"].item() == CAP and metrics["mismatch_capped_frac"].item() == 1.0
    assert metrics["mismatch_weight_ess"].item() == 1.0
    assert grad_unweighted.abs().sum() > 0
    torch.testing.assert_close(grad, CAP * grad_unweighted, rtol=0, atol=0)


def test_bypass_ratio_is_the_decoupled_ratio_times_the_untruncated_weight(injected_log_probs):
    """log s_i(bypass) = log s_i(decoupled) + mean_t(prox - beh): the decoupled form splits it."""
    data = stale_batch(4)
    _, _, rows_decoupled = reference("decoupled", **data["lists"])
    _, _, rows_bypass = reference("bypass", **data["lists"])
    lists = data["lists"]
    for i, (dec, byp) in enumerate(zip(rows_decoupled, rows_bypass)):
        if dec["n"]:
            tokens = [t for t in range(LENGTH) if lists["mask"][i][t]]
            log_b = sum(lists["prox"][i][t] - lists["beh"][i][t] for t in tokens) / dec["n"]
            assert byp["log_s"] == pytest.approx(dec["log_s"] + log_b, abs=1e-12)
    # at the first update of a step pi_theta = pi_prox: decoupled s_i = 1, nothing cut, however stale
    cfg = config("decoupled")
    _, _, metrics = run(cfg, micro_batch(data, cfg), data["proximal_log_probs"])
    _, _, bypass_metrics = run(config("bypass"), micro_batch(data, config("bypass")), data["proximal_log_probs"])
    assert metrics["clip_frac"].item() == 0.0 and metrics["log_ratio_seq_max"].item() == 0.0
    _, _, rows = reference("bypass", **{**lists, "lp": lists["prox"]})
    assert bypass_metrics["clip_frac"].item() == pytest.approx(reference_metrics(rows)["clip_frac"], abs=1e-15)
    assert bypass_metrics["clip_frac"].item() > 0.1  # bypass cuts stale sequences before any update


# ---------------------------------------------------------------------------------------------
# Reductions to plain GSPO and to today's default
# ---------------------------------------------------------------------------------------------


def test_behaviour_equal_to_proximal_is_plain_gspo_bit_for_bit(injected_log_probs):
    data = stale_batch(5)
    same = {**data, "rollout_log_probs": data["proximal_log_probs"].clone()}
    cfg = config("decoupled")
    loss, grad, metrics = run(cfg, micro_batch(same, cfg), data["log_probs"])
    plain_loss, plain_grad, plain_metrics = run(config("decoupled", mismatch_correction=False),
                                                micro_batch(same, cfg), data["log_probs"])
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    assert metrics["mismatch_weight_mean"].item() == 1.0 and metrics["mismatch_weight_ess"].item() == 1.0
    assert metrics["mismatch_capped_frac"].item() == 0.0
    for name, value in plain_metrics.items():
        assert torch.equal(metrics[name], value), name
    # and bypass with a behaviour policy equal to the proximal one is the same loss again
    bypass_loss, bypass_grad, _ = run(config("bypass"), micro_batch(same, config("bypass")), data["log_probs"])
    assert torch.equal(bypass_loss, loss) and torch.equal(bypass_grad, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_default_config_is_todays_loss_bit_for_bit(dtype, injected_log_probs):
    """The default is the decoupled form, i.e. the call the trainer made before the switch was
    named: pi_old recomputed, m_i from the rollout log-probs with cap 2.0."""
    cfg = GSPOConfig()
    assert config_from_dict({}).gspo == cfg
    assert cfg.old_logprobs == "recompute" and cfg.uses_behaviour_weight() and cfg.mismatch_cap == 2.0
    data = stale_batch(6)
    cast = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in data.items()}
    loss, grad, metrics = run(cfg, micro_batch(cast, cfg), cast["log_probs"])
    leaf = cast["log_probs"].clone().requires_grad_()
    today, today_metrics = gspo_loss(leaf, cast["proximal_log_probs"], cast["advantages"], cast["response_mask"],
                                     eps_low=3e-4, eps_high=4e-4, variant="gspo", loss_denominator=1.0,
                                     rollout_log_probs=cast["rollout_log_probs"], mismatch_cap=2.0)
    (today_grad,) = torch.autograd.grad(today, leaf)
    assert torch.equal(loss, today) and torch.equal(grad, today_grad)
    assert metrics.keys() == today_metrics.keys()
    assert all(torch.equal(metrics[k], today_metrics[k]) for k in metrics)


# ---------------------------------------------------------------------------------------------
# Context parallelism and packing: the trainer's own layouts, two simulated CP ranks
# ---------------------------------------------------------------------------------------------


def trainer_batch(data: dict) -> dict:
    """The padded ``[B, T]`` batch the layouts cut (tokens only give the shape)."""
    return {"tokens": torch.zeros(ROWS, LENGTH, dtype=torch.long), "response_mask": data["response_mask"],
            "advantages": data["advantages"], "rollout_log_probs": data["rollout_log_probs"],
            "proximal_log_probs": data["proximal_log_probs"], "policy_log_probs": data["log_probs"]}


def layout(batch: dict, kind: str, cp_rank: int, cp_size: int) -> dict:
    if kind == "packed":
        return batching.pack_micro_batch(batch, range(ROWS), cp_rank=cp_rank, cp_size=cp_size)
    return batching.split_rows_for_context_parallel(batch, cp_rank, cp_size)


def run_on_cp_ranks(cfg: GSPOConfig, batch: dict, kind: str, cp_size: int):
    """Every CP rank's (loss, grad, metrics), with a simulated all-reduce: pass 1 records each rank's
    per-sequence sums, pass 2 returns local + the other ranks' (detached): sum forward, identity
    backward, like ``context_parallel.SequenceAllReduce``. The loss makes exactly one call."""
    shares = [layout(batch, kind, r, cp_size) for r in range(cp_size)]
    mbs = []
    for share in shares:
        mb = dict(share)
        mb["old_log_probs"] = ratio_log_probs(cfg, share["proximal_log_probs"], mb)
        mbs.append(mb)
    recorded = [None] * cp_size

    def recording(rank):
        def reduce(sums):
            assert recorded[rank] is None, "more than one sequence_reduce call"
            recorded[rank] = sums.detach().clone()
            return sums
        return reduce

    for rank, mb in enumerate(mbs):
        run(cfg, mb, mb["policy_log_probs"], sequence_reduce=recording(rank))

    def all_reduce(rank):
        def reduce(sums):
            others = sum(recorded[r] for r in range(cp_size) if r != rank)
            return sums + others if cp_size > 1 else sums
        return reduce

    return [run(cfg, mb, mb["policy_log_probs"], sequence_reduce=all_reduce(rank)) for rank, mb in enumerate(mbs)]


@pytest.mark.parametrize("kind, cp_size", [("rows", 2), ("packed", 1), ("packed", 2)])
@pytest.mark.parametrize("form", FORMS)
def test_context_parallel_and_packed_equal_the_unsplit_loss(form, kind, cp_size, injected_log_probs):
    data = stale_batch(7)
    cfg = config(form)
    loss, grad, metrics = run(cfg, micro_batch(data, cfg), data["log_probs"])
    batch = trainer_batch(data)
    results = run_on_cp_ranks(cfg, batch, kind, cp_size)
    # the expected per-rank gradient: the unsplit one, cut into the same layout
    expected_grads = [layout({**batch, "policy_log_probs": grad}, kind, r, cp_size)["policy_log_probs"]
                      for r in range(cp_size)]
    for rank, (rank_loss, rank_grad, rank_metrics) in enumerate(results):
        assert rank_loss.item() == pytest.approx(loss.item(), abs=1e-12)  # every rank: the full loss
        assert rank_metrics.keys() == metrics.keys()
        for name, value in metrics.items():
            assert rank_metrics[name].item() == pytest.approx(value.item(), abs=1e-12), name
        torch.testing.assert_close(rank_grad, expected_grads[rank], rtol=1e-12, atol=1e-14)
    if cp_size == 2:  # the rows really are split: each rank holds part of the long sequences
        assert all(r[1].abs().sum() > 0 for r in results)
    if form == "decoupled":
        assert 0 < metrics["mismatch_capped_frac"].item() < 1


# ---------------------------------------------------------------------------------------------
# The weight's statistics over micro-batches, and the configuration
# ---------------------------------------------------------------------------------------------


def test_ess_over_microbatches_is_the_ess_of_all_sequences(injected_log_probs):
    data = stale_batch(8)
    cfg = config("decoupled")

    def metrics(rows: slice) -> dict:
        part = {k: (v[rows] if torch.is_tensor(v) else v) for k, v in data.items()}
        return {k: float(v) for k, v in run(cfg, micro_batch(part, cfg), part["log_probs"])[2].items()}

    whole = metrics(slice(0, ROWS))
    # 1 padding row alone (no sequence), then 7 and 16 rows
    combined = combine_metrics([metrics(slice(0, 1)), metrics(slice(1, 8)), metrics(slice(8, ROWS))])
    _, _, rows = reference("decoupled", **data["lists"])
    expected = reference_metrics(rows)
    for name in ("mismatch_weight_mean", "mismatch_weight_max", "mismatch_weight_ess", "mismatch_capped_frac",
                 "clip_frac"):
        assert combined[name] == pytest.approx(expected[name], abs=1e-12), name
        assert whole[name] == pytest.approx(expected[name], abs=1e-12), name


def test_ess_by_hand():
    # weights 2, 1, 1 (3 sequences) and 0.5 (1 sequence): (4.5)^2 / (4 * 6.25) = 0.81
    first = {"num_sequences": 3, "mismatch_weight_mean": 4 / 3, "mismatch_weight_ess": 16 / (3 * 6)}
    second = {"num_sequences": 1, "mismatch_weight_mean": 0.5, "mismatch_weight_ess": 1.0}
    empty = {"num_sequences": 0, "mismatch_weight_mean": 0.0, "mismatch_weight_ess": 0.0}
    out = combine_metrics([first, empty, second])
    assert out["mismatch_weight_ess"] == pytest.approx(4.5 ** 2 / (4 * 6.25), abs=1e-15)
    assert combine_metrics([empty])["mismatch_weight_ess"] == 0.0


def test_one_switch_and_old_configs():
    # the switch: old_logprobs; the weight follows it unless set
    assert GSPOConfig().uses_behaviour_weight()
    assert not GSPOConfig(old_logprobs="rollout").uses_behaviour_weight()
    bypass = config_from_dict({}, ["gspo.old_logprobs=rollout"]).gspo
    assert bypass.old_logprobs == "rollout" and not bypass.uses_behaviour_weight()
    # old configs keep working
    assert GSPOConfig(old_logprobs="rollout", mismatch_correction=False).uses_behaviour_weight() is False
    assert GSPOConfig(mismatch_correction=True).uses_behaviour_weight()
    assert not GSPOConfig(mismatch_correction=False).uses_behaviour_weight()
    assert config_from_dict({}, ["gspo.mismatch_correction=true"]).gspo.mismatch_correction is True
    # and the contradiction names the field
    with pytest.raises(ConfigError, match=r"gspo\.mismatch_correction: true needs gspo\.old_logprobs: recompute"):
        GSPOConfig(old_logprobs="rollout", mismatch_correction=True)
    with pytest.raises(ConfigError, match=r"gspo\.mismatch_cap: must be >= 1"):
        GSPOConfig(mismatch_cap=0.5)
