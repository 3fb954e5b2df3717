"""Issue 38, item 15: a NaN loss is neither applied nor pushed.

* Every variant parameter has a range (``variants.PARAM_RANGES``), refused outside it naming the
  field and the range (``gspo.sapo.tau_pos: 1e308`` was accepted, and its float32 gate is NaN:
  shown here with the loss itself); at the ends of each range the float32 loss and gradient stay
  finite for log-ratios across the clamp (+-25).
* ``finite_check``: the verdict names the term and NaN / inf; a run stopped by it exits 1 with one
  line and no traceback; the loop trains nothing after it (no weight push, no checkpoint).
  The real Megatron update on two ranks: tests/distributed/test_nonfinite_update.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from launch import cli, show_config
from megatron_gspo.config import ConfigError, config_from_dict
from megatron_gspo.loss.gspo import LOG_RATIO_LIMIT, gspo_loss
from megatron_gspo.loss.variants import (PARAM_RANGES, CispoParams, GmpoParams, ParamRange,
                                         SapoParams)
from megatron_gspo.train.finite_check import NonFiniteError, check_update, describe, local_flags
from pipeline.step import loop
from tests.reliability.loop_fakes import FakePusher, FakeTrainer, init_world_of_one, loop_context

PARAMS = {"cispo": CispoParams, "sapo": SapoParams, "gmpo": GmpoParams}


def _outside(allowed: ParamRange) -> list[float]:
    low = allowed.low - (1e-3 if allowed.low_inclusive else 0.0)
    return [low, allowed.high * 1.001, 1e308]


@pytest.mark.parametrize("dotted", sorted(PARAM_RANGES))
def test_every_variant_parameter_out_of_its_range_is_refused_naming_field_and_range(dotted):
    section, name = dotted.split(".")
    allowed = PARAM_RANGES[dotted]
    for value in _outside(allowed):
        with pytest.raises(ConfigError) as err:
            config_from_dict({"gspo": {section: {name: value}}})
        assert str(err.value).startswith(f"gspo.{dotted}: must be in {allowed}, got {value} ("), \
            str(err.value)
    for value in (math.nan, math.inf, -math.inf):  # the loader refuses these for every float
        with pytest.raises(ConfigError, match=rf"^gspo\.{section}\.{name}: must be a finite"):
            config_from_dict({"gspo": {section: {name: value}}})
    assert math.nan not in allowed and math.inf not in allowed  # and so would the range
    ends = [allowed.high] + ([allowed.low] if allowed.low_inclusive else [allowed.low + 1e-6])
    for value in ends:  # the ends are accepted, whichever variant is in use
        got = config_from_dict({"gspo": {"variant": section, section: {name: value}}}).gspo
        assert getattr(getattr(got, section), name) == value


def test_the_coefficients_are_bounded_too():
    for name, value in (("kl_coef", 1e308), ("entropy_coef", -1e308), ("kl_coef", -0.1)):
        with pytest.raises(ConfigError, match=rf"^gspo\.{name}: must be in \["):
            config_from_dict({"gspo": {name: value}})


def test_the_gmpo_range_is_the_loss_clamp():
    assert PARAM_RANGES["gmpo.log_eps_high"].high == LOG_RATIO_LIMIT


def _loss(variant: str, params, log_ratio: torch.Tensor, advantages: torch.Tensor):
    """gspo_loss in float32 on [B, T] log-ratios; the loss, its gradient, the metrics."""
    old = torch.full_like(log_ratio, -1.0)
    log_probs = (old + log_ratio).requires_grad_(True)
    mask = torch.ones_like(log_ratio, dtype=torch.bool)
    eps = {"cispo": (params.eps_low, params.eps_high) if variant == "cispo" else None,
           "gmpo": (params.log_eps_low, params.log_eps_high) if variant == "gmpo" else None
           }.get(variant) or (0.2, 0.28)
    loss, metrics = gspo_loss(log_probs, old, advantages, mask, eps_low=eps[0], eps_high=eps[1],
                              variant=variant, params=params if variant == "sapo" else None)
    loss.backward()
    return loss.detach(), log_probs.grad, metrics


def _extreme_batch():
    # every token's log-ratio from -25 to 25 (past the +-20 clamp), w = 1 exactly in the middle
    log_ratio = torch.linspace(-25.0, 25.0, 11, dtype=torch.float32).repeat(4, 1)
    advantages = torch.tensor([1.5, -1.5, 0.5, -0.5], dtype=torch.float32)
    return log_ratio, advantages


@pytest.mark.parametrize("dotted", sorted(PARAM_RANGES))
def test_at_the_ends_of_each_range_the_float32_loss_and_gradient_are_finite(dotted):
    section, name = dotted.split(".")
    allowed = PARAM_RANGES[dotted]
    log_ratio, advantages = _extreme_batch()
    for value in (allowed.high, allowed.low if allowed.low_inclusive else allowed.low + 1e-6):
        params = PARAMS[section](**{name: value})
        loss, grad, _ = _loss(section, params, log_ratio, advantages)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (dotted, value, loss)


def test_what_the_config_now_refuses_makes_the_loss_nan():
    """The issue's case: tau 1e308 is inf in float32; at w = 1 the gate is inf * 0."""
    log_ratio, advantages = _extreme_batch()
    loss, _, metrics = _loss("sapo", SapoParams(tau_pos=1e308), log_ratio, advantages)
    assert torch.isnan(loss)
    flags = local_flags([{**metrics, "loss_sum": loss}], [])
    assert describe(flags.tolist()).startswith(
        "non-finite loss: the policy term (gspo.variant) is NaN, the loss is NaN. The update was "
        "not applied")


class _Chunk(torch.nn.Module):
    def __init__(self, grad: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(3, 4))
        self.weight.grad = torch.zeros(3, 4)
        self.weight.grad[1, 2] = grad


def test_the_verdict_names_each_term_and_nan_or_inf():
    finite = {"policy_loss": torch.tensor(0.5), "loss_sum": torch.tensor(1.0)}
    check_update([finite, finite], [_Chunk(0.25)])  # all finite: nothing raised
    bad = {"policy_loss": torch.tensor(0.5), "kl_mean": torch.tensor(math.inf),
           "entropy_mean": torch.tensor(math.nan), "loss_sum": torch.tensor(math.nan)}
    with pytest.raises(NonFiniteError) as err:
        check_update([finite, bad], [_Chunk(0.25)])
    assert str(err.value).startswith(
        "non-finite loss: the KL term (gspo.kl_coef) is inf, the entropy term "
        "(gspo.entropy_coef) is NaN, the loss is NaN. The update was not applied")
    for grad, word in ((math.inf, "inf"), (-math.inf, "inf"), (math.nan, "NaN")):
        with pytest.raises(NonFiniteError, match=rf"^non-finite gradient \(the loss is finite\): "
                                                 rf"the gradient is {word}\."):
            check_update([finite], [_Chunk(0.25), _Chunk(grad)])


def test_a_non_finite_update_exits_1_with_one_line_and_no_traceback(monkeypatch, capfd):
    def fails(args, argv):
        err = NonFiniteError(describe([2.0, 0.0, 0.0, 2.0, 2.0]))
        err.add_note("step 2: update 1/1")
        raise err

    monkeypatch.setattr(show_config, "main", fails)
    code = cli.main(["config", "--config", "launch/configs/tiny_cpu.yaml"])
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("megatron-gspo config: step 2: update 1/1: NonFiniteError: "
                               "non-finite loss: the policy term (gspo.variant) is NaN"), lines[0]


def test_the_loop_pushes_and_saves_nothing_after_a_non_finite_update(tmp_path):
    class Diverging(FakeTrainer):
        def train_rollout(self, batch, step):
            if step == 3:
                raise NonFiniteError(describe([2.0, 0.0, 0.0, 2.0, 2.0]))
            return super().train_rollout(batch, step)

    made = init_world_of_one()
    try:
        pusher, trainer = FakePusher(), Diverging()
        ctx = loop_context(tmp_path, steps=5, save_interval=1, pusher=pusher)
        with pytest.raises(NonFiniteError):
            loop.run(ctx, trainer, start_step=0)
        ctx.logger.close()
    finally:
        if made:
            dist.destroy_process_group()
    assert trainer.trained == [1, 2] and trainer.saved == [1, 2]
    assert len(pusher.pushes) == 3  # the start's weights, then steps 1 and 2; nothing of step 3
