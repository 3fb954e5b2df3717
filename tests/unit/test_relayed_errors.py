"""Errors cross ranks as types (pipeline/relayed_errors.py; issue 22 item 4): rank 0's error is
re-raised on every rank with its type name, phase and step, and input errors stay input errors
whatever their message says."""

from __future__ import annotations

import pytest

from pipeline.signals import StopFlag
from pipeline.step.rank0 import PhaseFailed
from pipeline.step.step_guard import StepGuard

from pipeline import relayed_errors
from pipeline.scoring.data import DataError
from pipeline.relayed_errors import RelayedError
from pipeline.scoring.rewards import RewardError


class CustomDataError(DataError):
    pass


class NoSignal(StopFlag):
    def any_rank(self) -> bool:  # one process: no collective
        return False


def _raise_on_rank0(err):
    """What StepGuard does on every rank after rank 0's phase raised ``err``."""
    guard = StepGuard(NoSignal(), save=lambda *a: None, data_position=dict, start_step=0)
    guard.begin(1)
    desc = relayed_errors.describe(err)
    with pytest.raises(RelayedError) as info:
        with guard.before_update():
            raise PhaseFailed(f"evaluation: {desc['type']}: {desc['message']}", error=desc,
                                   phase="evaluation")
    return info.value


def test_an_input_error_of_rank_0_is_an_input_error_on_every_rank():
    relayed = _raise_on_rank0(RewardError("every one of the 16 rewards failed"))
    assert str(relayed) == "step 1: evaluation: RewardError: every one of the 16 rewards failed"
    assert relayed.input_error and relayed_errors.is_input_error(relayed)
    assert (relayed.step, relayed.phase, relayed.type_name) == (1, "evaluation", "RewardError")


def test_the_type_decides_not_the_message():
    # a crash whose message looks like an input error's text is still a crash ...
    crash = _raise_on_rank0(KeyError("step 3: RewardError: "))
    assert not crash.input_error and not relayed_errors.is_input_error(crash)
    # ... and a subclass of an input error is one
    assert _raise_on_rank0(CustomDataError("row 7 of data.jsonl: no prompt")).input_error


def test_describe_is_plain_data():
    desc = relayed_errors.describe(ValueError("x"))
    assert desc == {"type": "ValueError", "message": "x", "input_error": False}
