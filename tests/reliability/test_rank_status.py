"""The launcher's one verdict from its ranks' reports (``launch.rank_status.outcome``).

The rules the signal and launcher tests rely on, case by case: a rank killed by a signal that is
not a stop signal is the root cause; otherwise the earliest error (its traceback only for a
crash, never for an input error); then a preemption (75); 0 only when every rank finished.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from launch.rank_status import outcome


def write(directory: Path, ranks: dict[int, dict], torchrun: dict[int, int] | None = None) -> Path:
    for rank, status in ranks.items():
        (directory / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "time": 0.0, "error": None, "traceback": None, "log": None, **status}))
    if torchrun is not None:
        (directory / "torchrun.json").write_text(json.dumps(
            {str(r): {"exitcode": c, "time": 0.0} for r, c in torchrun.items()}))
    return directory


def verdict(directory: Path, agent_code: int = 1, world: int = 2):
    return outcome(directory, world_size=world, agent_code=agent_code, command="train",
                   log_dir=Path("/run/logs"))


def test_a_rank_killed_by_sigkill_is_the_root_cause(tmp_path):
    write(tmp_path, {0: {"code": 1, "error": "RuntimeError: gloo: connection closed", "time": 5}},
          torchrun={1: -signal.SIGKILL, 0: 1})
    result = verdict(tmp_path)
    assert result.code == 1
    assert result.message == ("megatron-gspo train: rank 1 was killed by SIGKILL "
                              "(its log: /run/logs/rank1.log)")


def test_the_earliest_error_wins_and_a_rank_stopped_by_torchrun_is_not_a_cause(tmp_path):
    write(tmp_path, {1: {"code": 2, "error": "step 1: RewardError: boom", "time": 2.0,
                         "log": "/run/logs/rank1.log"},
                     0: {"code": 1, "error": "RuntimeError: late echo", "time": 3.0,
                         "traceback": "Traceback ..."}},
          torchrun={0: -signal.SIGTERM, 1: 2})
    result = verdict(tmp_path)
    assert (result.code, result.detail) == (2, None)  # an input error: one line, no traceback
    assert result.message == ("megatron-gspo train: rank 1: step 1: RewardError: boom "
                              "(full log: /run/logs/rank1.log)")


def test_a_crash_shows_its_traceback_once(tmp_path):
    write(tmp_path, {0: {"code": 1, "error": "KeyError: 'x'", "traceback": "Traceback (most...",
                         "time": 1.0}, 1: {"code": 0}})
    result = verdict(tmp_path)
    assert result.code == 1 and result.detail == "Traceback (most..."


def test_one_preempted_rank_means_the_checkpoint_is_complete(tmp_path):
    write(tmp_path, {1: {"code": 75}}, torchrun={1: 75, 0: -signal.SIGTERM})
    assert verdict(tmp_path).code == 75


def test_finished_only_when_every_rank_says_so(tmp_path):
    write(tmp_path, {0: {"code": 0}, 1: {"code": 0}})
    assert verdict(tmp_path, agent_code=0).code == 0
    (tmp_path / "rank1.json").unlink()
    result = verdict(tmp_path, agent_code=143)
    assert result.code == 143 and "ranks [1] ended without reporting" in result.message


def test_a_stop_signal_during_the_last_step_is_a_finished_run(tmp_path):
    """Issue 22, item 7: SIGTERM during the last step. The ranks finish the step, export hf/ and
    report 0; torchrun, stopped by the signal itself, exits 143. The run is complete: exit 0
    (it was 143 with "ranks [] ended without reporting")."""
    write(tmp_path, {0: {"code": 0}, 1: {"code": 0}})
    result = verdict(tmp_path, agent_code=128 + signal.SIGTERM)
    assert result.code == 0
    assert result.message == ("megatron-gspo train: the run finished (the stop signal came "
                              "during its last step); nothing to resume")
    assert "without reporting" not in result.message
