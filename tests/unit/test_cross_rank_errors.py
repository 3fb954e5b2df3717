"""Errors cross ranks as types (megatron_gspo/errors.py, megatron_gspo/collectives.py; issue 22
item 4, issue 34 item 4): rank 0's error is raised on every rank as its own type (or a RemoteError
that keeps the type's name, the message and the input-error flag), with where it happened; input
errors are input errors by their type (the InputError marker), whatever their message says, and
end the run with exit status 2 and one line on every rank."""

from __future__ import annotations

import argparse
import contextlib
import io
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.spawn import run_on_ranks
from launch import cli
from launch.run_lock import RunDirLocked
from megatron_gspo import collectives
from megatron_gspo.config import ConfigError
from megatron_gspo.errors import InputError, RemoteError, is_input_error, one_line
from megatron_gspo.hf import safetensors_io
from megatron_gspo.hf.gather import WeightSyncError
from megatron_gspo.hf.hf_config import HFConfigError
from megatron_gspo.train import checkpoint
from pipeline.scoring.data import DataError
from pipeline.scoring.rewards import RewardError
from pipeline.signals import StopFlag
from pipeline.step import phases
from pipeline.step.rank0 import everywhere, on_main
from pipeline.step.step_guard import StepGuard


class CustomDataError(DataError):
    pass


class NoSignal(StopFlag):
    def any_rank(self) -> bool:  # no collective
        return False


def _guard() -> StepGuard:
    guard = StepGuard(NoSignal(), save=lambda *a: None, data_position=dict, start_step=0)
    guard.begin(1)
    return guard


def _raise_on_rank0(err: BaseException) -> BaseException:
    """What StepGuard raises (one process: rank 0) after rank 0's phase raised ``err``."""
    ctx = SimpleNamespace(control_group=None, servers=None, resync=None)

    def phase():
        raise err
    with pytest.raises(BaseException) as info:
        with _guard().before_update():
            on_main(ctx, phase, what="evaluation")
    return info.value


@pytest.mark.parametrize("cls,base", [
    (ConfigError, ValueError), (HFConfigError, ValueError),
    (safetensors_io.CheckpointError, ValueError), (checkpoint.CheckpointError, RuntimeError),
    (WeightSyncError, RuntimeError), (DataError, ValueError), (RewardError, RuntimeError),
    (RunDirLocked, RuntimeError)])
def test_every_input_error_class_is_an_input_error_and_keeps_its_base(cls, base):
    assert issubclass(cls, InputError) and issubclass(cls, base)
    assert is_input_error(cls("x"))


def test_an_input_error_of_rank_0_is_an_input_error_on_every_rank():
    err = _raise_on_rank0(RewardError("every one of the 16 rewards failed"))
    assert type(err) is RewardError and is_input_error(err)
    assert one_line(err) == "step 1: evaluation: RewardError: every one of the 16 rewards failed"


def test_the_type_decides_not_the_message():
    # a crash whose message looks like an input error's text is still a crash ...
    crash = _raise_on_rank0(KeyError("step 3: RewardError: "))
    assert type(crash) is KeyError and not is_input_error(crash)
    # ... and a subclass of an input error is one
    assert is_input_error(_raise_on_rank0(CustomDataError("row 7 of data.jsonl: no prompt")))
    # nothing is recognised by its class name either
    assert not is_input_error(type("RewardError", (RuntimeError,), {})("x"))


def test_an_error_that_does_not_pickle_arrives_as_a_remote_error_that_keeps_its_kind():
    local = type("ServiceError", (DataError,), {})  # not importable: does not pickle
    failure = collectives.Failure.of(local("row 3: no label"))
    assert failure.pickled is None
    err = failure.error()
    assert isinstance(err, RemoteError) and is_input_error(err)
    assert (err.kind, err.message) == ("ServiceError", "row 3: no label")
    assert one_line(err) == "ServiceError: row 3: no label"
    crash = collectives.Failure.of(type("Boom", (RuntimeError,), {})("x")).error()
    assert isinstance(crash, RemoteError) and not is_input_error(crash)
    assert type(pickle.loads(pickle.dumps(err))) is type(err)  # it crosses ranks again


def test_an_error_that_pickles_arrives_as_itself_with_its_notes():
    err = checkpoint.CheckpointDiskFull("checkpoint step_000002: no space left", "/ckpt/x.tmp")
    err.add_note("saving")
    copy = collectives.Failure.of(err).error()
    assert type(copy) is checkpoint.CheckpointDiskFull and copy.errno == err.errno
    assert (str(copy), copy.filename, copy.__notes__) == (str(err), err.filename, ["saving"])


def test_one_process_runs_on_rank0_itself():
    assert collectives.on_rank0(lambda a, b: a + b, 1, 2, group=None) == 3
    with pytest.raises(DataError, match="bad row"):
        collectives.on_rank0(lambda: (_ for _ in ()).throw(DataError("bad row")), group=None)


def _run_cli(body) -> tuple[int, str]:
    """``launch.cli.main`` of a sub-command that runs ``body``: (exit status, stderr)."""
    parser = argparse.ArgumentParser()
    parser.add_subparsers(dest="command").add_parser("train").set_defaults(
        func=lambda args, argv: body())
    real, cli.build_parser = cli.build_parser, lambda command=None: parser
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = cli.main(["train"])
    except Exception as crash:  # noqa: BLE001 - a crash (exit 1 with the traceback)
        code, err = 1, io.StringIO(f"{type(crash).__name__}: {crash}")
    finally:
        cli.build_parser = real
    return code, err.getvalue()


def _input_error_mid_run_rank(rank: int, world: int) -> dict:
    """Rank 0's reward / data error mid-run, through ``on_main`` (a phase of the step) and through
    ``phases._pool_call`` (the rollout servers' check before a weight sync): every rank's exit."""
    ctx = SimpleNamespace(control_group=None, servers=None, resync=None)

    def rollout():  # runs on rank 0 only
        raise RewardError("every one of the 32 rewards failed (reward.function "
                          "flaky.py:always_fails: ValueError: the reward service is down)")

    def pool_check():  # runs on rank 0 only
        raise DataError("data.jsonl row 7: no prompt")

    def step():
        with _guard().before_update():
            on_main(ctx, rollout, what="rollout")

    def sync():
        with _guard().after_update():
            everywhere(phases._pool_call, ctx, pool_check, what="weight sync")

    not_typed = type("Unimportable", (RewardError,), {})

    def remote():
        with _guard().before_update():
            on_main(ctx, lambda: (_ for _ in ()).throw(not_typed("reward.function: x")),
                         what="evaluation")

    return {"on_main": _run_cli(step), "pool_call": _run_cli(sync), "remote": _run_cli(remote)}


def test_an_input_error_on_rank_0_mid_run_exits_2_with_one_line_on_every_rank():
    results = run_on_ranks(2, _input_error_mid_run_rank, timeout_s=120)
    for rank, out in enumerate(results):
        for path, line in (
                ("on_main", "megatron-gspo train: step 1: rollout: RewardError: every one of the 32 "
                            "rewards failed (reward.function flaky.py:always_fails: ValueError: "
                            "the reward service is down)"),
                ("pool_call", "megatron-gspo train: rollout servers: DataError: data.jsonl row 7: "
                              "no prompt"),
                ("remote", "megatron-gspo train: step 1: evaluation: Unimportable: "
                           "reward.function: x")):
            code, stderr = out[path]
            assert code == 2, (rank, path, stderr)
            assert stderr.splitlines() == [line], (rank, path, stderr)


def _crash_mid_run_rank(rank: int, world: int) -> tuple[int, str]:
    ctx = SimpleNamespace(control_group=None, servers=None, resync=None)

    def step():
        with _guard().before_update():
            on_main(ctx, lambda: {}["step"], what="rollout")
    return _run_cli(step)


def test_a_crash_on_rank_0_is_a_crash_on_every_rank():
    for code, text in run_on_ranks(2, _crash_mid_run_rank, timeout_s=120):
        assert code == 1 and text == "KeyError: 'step'", text


def _library_sites_rank(rank: int, world: int, run_dir: str) -> dict:
    """The library's and the launcher's own rank-0 checks, through on_rank0: the run lock
    (``launch.run_lock.hold``) and the routing-replay row scatter (``scatter_rows``)."""
    import torch

    from launch.run_lock import hold
    from megatron_gspo.train.row_scatter import scatter_rows

    out = {}
    if rank == 0:
        (Path(run_dir) / "run.lock").mkdir(parents=True)  # a directory: the lock is unusable
    try:
        with hold(run_dir):
            out["lock"] = "held"
    except RunDirLocked as err:
        out["lock"] = f"RunDirLocked: {err}"
    full = torch.arange(12.0).reshape(4, 3) if rank == 0 else None
    out["rows"] = scatter_rows(full, torch.tensor([3, rank]), (3,), torch.float32).tolist()
    try:
        scatter_rows(full, torch.tensor([4 + rank]), (3,), torch.float32)
    except ValueError as err:
        out["bad_rows"] = str(err)
    try:
        scatter_rows(full, torch.tensor([0]), (2,), torch.float32)
    except ValueError as err:
        out["bad_shape"] = str(err)
    return out


def test_the_run_lock_and_the_row_scatter_raise_rank_0s_error_on_every_rank(tmp_path):
    results = run_on_ranks(2, _library_sites_rank, (str(tmp_path),), timeout_s=120)
    for rank, out in enumerate(results):
        assert out["lock"].startswith(f"RunDirLocked: run.output_dir: the lock file "
                                      f"{tmp_path / 'run.lock'} is a directory"), out
        assert out["rows"] == [[9.0, 10.0, 11.0], [3.0 * rank, 3.0 * rank + 1, 3.0 * rank + 2]]
        assert out["bad_rows"] == "rank 0 asks for rows [4] of a tensor of 4 rows", out
        assert out["bad_shape"] == "rows of shape (3,) to scatter, the ranks expect (2,)", out
