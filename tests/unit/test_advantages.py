"""Group-relative advantages against a per-group Python loop (tests/unit/gspo_reference.py)."""

import math

import pytest
import torch

from tests.unit.gspo_reference import reference_group_advantages
from megatron_gspo.loss.advantages import group_advantages, is_zero_std_group
from megatron_gspo.loss.gspo import group_advantages as reexported_group_advantages


def random_rewards(num_groups: int, group_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(num_groups * group_size, generator=generator, dtype=torch.float64)
    rewards[:group_size] = 0.1  # a zero-std group whose mean does not round to exactly 0.1
    rewards[group_size:2 * group_size] = torch.tensor([1.0, 0.0] * group_size, dtype=torch.float64)[:group_size]
    return rewards


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_matches_reference(normalize_std, leave_one_out, group_size):
    rewards = random_rewards(num_groups=5, group_size=group_size, seed=group_size)
    advantages = group_advantages(rewards, group_size, normalize_std=normalize_std, leave_one_out=leave_one_out)
    expected = reference_group_advantages(rewards.tolist(), group_size, normalize_std=normalize_std,
                                          leave_one_out=leave_one_out)
    assert advantages.dtype == torch.float64 and advantages.shape == rewards.shape
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_worked_example_population_std():
    advantages = group_advantages(torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64), 3)
    population_std = math.sqrt((0.25 + 0.0 + 0.25) / 3)  # 0.40825, not the sample std 0.5
    expected = [0.5 / (population_std + 1e-6), 0.0, -0.5 / (population_std + 1e-6)]
    torch.testing.assert_close(advantages, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert abs(advantages[0].item() - 1.2247) < 1e-4


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_zero_std_group_is_exactly_zero(normalize_std, leave_one_out):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 1.0, 0.0, 0.5], dtype=torch.float32)
    advantages = group_advantages(rewards, 3, normalize_std=normalize_std, leave_one_out=leave_one_out, eps=0.0)
    assert torch.equal(advantages[:6], torch.zeros(6))
    assert torch.isfinite(advantages).all() and (advantages[6:] != 0).sum() == 2
    assert is_zero_std_group(rewards, 3).tolist() == [True, True, False]


def test_normalize_std_off_is_centred_rewards():
    rewards = torch.tensor([3.0, 1.0, 2.0, 2.0])
    assert group_advantages(rewards, 2, normalize_std=False).tolist() == [1.0, -1.0, 0.0, 0.0]


def test_leave_one_out_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 4, normalize_std=False, leave_one_out=True)
    torch.testing.assert_close(advantages, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3], dtype=torch.float64))


def test_accepts_lists_integers_and_group_size_one():
    assert group_advantages([1, 2, 3], 1).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages([1, 3], 2, normalize_std=False).dtype == torch.get_default_dtype()
    assert group_advantages(torch.zeros(0), 4).shape == (0,)
    assert reexported_group_advantages is group_advantages


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"len\(rewards\)=7 is not a multiple of group_size=3"):
        group_advantages(torch.zeros(7), 3)
    with pytest.raises(ValueError, match=r"rewards\[4\] = nan is not finite"):
        group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0, math.nan, math.inf]), 3)
    with pytest.raises(ValueError, match=r"rewards\[1\] = inf"):
        group_advantages(torch.tensor([0.0, math.inf]), 2)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match="leave_one_out needs group_size >= 2"):
        group_advantages(torch.zeros(4), 1, leave_one_out=True)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2), 2, eps=-1.0)
