"""Group-relative advantages for GSPO / GRPO (pure torch, no distributed, no config).

Reference: docs/gspo_math.md, section "Advantages (group-relative)".

Layout: rewards are group-contiguous. With group size G, rows ``g*G .. g*G + G - 1`` are the G
responses sampled for prompt g.

Shape suffixes: B num_sequences (= P * G), P num_prompts (groups), G group_size.

For the G rewards r_1..r_G of one prompt:

    mean = (1/G) sum_j r_j
    std  = sqrt( (1/G) sum_j (r_j - mean)^2 )          POPULATION std (divides by G, not G - 1)
    b_i  = mean                                         default baseline
         = (1/(G-1)) sum_{j != i} r_j                   leave_one_out=True (RLOO baseline)
    A_i  = (r_i - b_i) / (std + eps)                    normalize_std=True (GRPO/GSPO)
         =  r_i - b_i                                   normalize_std=False (Dr. GRPO)

The leave-one-out centring is computed as ``r_i - b_i = G/(G-1) * (r_i - mean)`` (same value).
A group whose G rewards are all equal (std 0) gets ``A_i = 0`` exactly for every baseline and
normalisation: such groups carry no learning signal, and the zero is enforced with a test on the
rewards themselves (max == min), not by hoping ``r_i - mean`` rounds to 0.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["group_advantages", "is_zero_std_group"]


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    leave_one_out: bool = False,
) -> Tensor:
    """Group-relative advantages ``A_i = (r_i - b_i) / (std + eps)`` (see the module docstring).

    Args:
        rewards: ``[B]`` rewards, group-contiguous (G consecutive responses per prompt). A list
            is accepted; integer rewards are converted to the default float dtype.
        group_size: G, responses per prompt; ``B`` must be a multiple of it.
        normalize_std: divide by ``std + eps`` (the population std of the group). False gives the
            Dr. GRPO advantage ``r_i - b_i``.
        eps: added to the std before dividing (only used with ``normalize_std``).
        leave_one_out: use the mean of the other G - 1 rewards as baseline (needs G >= 2).

    Returns:
        ``[B]`` advantages in the rewards' (floating) dtype; exactly 0 for every response of a
        group whose rewards are all equal.

    Raises:
        ValueError: rewards not 1-D, ``B % group_size != 0``, group_size < 1 (or < 2 with
            leave_one_out), eps < 0, or a reward that is NaN/inf (the message names the index of
            the first one).
    """
    rewards_PG = _rewards_by_group(rewards, group_size)
    if eps < 0:
        raise ValueError(f"eps={eps} must be >= 0")
    if leave_one_out and group_size < 2:
        raise ValueError("leave_one_out needs group_size >= 2 (the baseline is the mean of the other responses)")
    if rewards_PG.shape[0] == 0:  # no group: nothing to centre (torch.std would warn about 0 samples)
        return rewards_PG.reshape(-1).clone()

    centered_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if leave_one_out:
        # r_i - (sum_j r_j - r_i) / (G - 1) = (G r_i - sum_j r_j) / (G - 1) = G/(G-1) (r_i - mean)
        centered_PG = centered_PG * (group_size / (group_size - 1))
    if normalize_std:
        std_P1 = rewards_PG.std(dim=1, correction=0, keepdim=True)  # population std
        centered_PG = centered_PG / (std_P1 + eps)

    is_zero_std_P1 = _is_zero_std(rewards_PG).unsqueeze(1)
    advantages_PG = torch.where(is_zero_std_P1, torch.zeros_like(centered_PG), centered_PG)
    return advantages_PG.reshape(-1)


def is_zero_std_group(rewards: Tensor | Sequence[float], group_size: int) -> Tensor:
    """``[P]`` bool: True for each prompt whose G rewards are all equal (std 0, no signal).

    Its mean is the "fraction of zero-std groups" metric; dynamic sampling drops these groups.
    Validates ``rewards`` and ``group_size`` like :func:`group_advantages`.
    """
    return _is_zero_std(_rewards_by_group(rewards, group_size))


def _is_zero_std(rewards_PG: Tensor) -> Tensor:
    if rewards_PG.shape[1] == 0:
        return torch.zeros(rewards_PG.shape[0], dtype=torch.bool, device=rewards_PG.device)
    return rewards_PG.amax(dim=1) == rewards_PG.amin(dim=1)


def _rewards_by_group(rewards: Tensor | Sequence[float], group_size: int) -> Tensor:
    """Validate rewards and group size; return rewards viewed as ``[P, G]``."""
    rewards_B = torch.as_tensor(rewards)
    if not rewards_B.is_floating_point():
        rewards_B = rewards_B.to(torch.get_default_dtype())
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_sequences], got shape {tuple(rewards_B.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    num_sequences = rewards_B.shape[0]
    if num_sequences % group_size != 0:
        raise ValueError(
            f"len(rewards)={num_sequences} is not a multiple of group_size={group_size}: rewards must hold "
            f"group_size consecutive responses per prompt"
        )
    is_finite_B = torch.isfinite(rewards_B)
    if not bool(is_finite_B.all()):
        first_bad = int((~is_finite_B).nonzero()[0, 0])
        raise ValueError(
            f"rewards[{first_bad}] = {rewards_B[first_bad].item()} is not finite "
            f"(prompt {first_bad // group_size}, response {first_bad % group_size})"
        )
    return rewards_B.reshape(-1, group_size)
