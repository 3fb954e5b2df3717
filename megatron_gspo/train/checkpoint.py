"""Training checkpoints: model and optimizer (Megatron dist_checkpointing, torch_dist), RNG states,
and the run's own state (step, data position, weight version), saved atomically.

Layout of ``<run_dir>/checkpoints``::

    step_000012/            one checkpoint (a torch_dist directory written by every rank)
        model_optim/        dist_checkpointing: model + optimizer, layout-independent
        rank_00003.pt       this rank's RNG states
        scheduler.json      the LR schedule's state (Megatron's OptimizerParamScheduler), rank 0
        run_state.json      step, data sampler position, weight version, ... (rank 0)
    latest                  text file: the name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp`` and renamed by rank 0 after every rank has finished
(barrier), then ``latest`` is replaced atomically: a rank killed mid-save leaves a ``.tmp``
directory that resume ignores. Model and optimizer shards use Megatron's ``sharded_state_dict``, so a
checkpoint written under one parallel layout loads under another.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint of a run, or None."""
    root = checkpoint_root(run_dir)
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    if not (path / "run_state.json").is_file():
        raise RuntimeError(f"{marker} names {path.name}, which is not a complete checkpoint")
    return path


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["cuda_tracker"])


def _module(chunk):
    """The GPTModel inside Megatron's DDP wrapper (whose state-dict keys carry ``module.``)."""
    return getattr(chunk, "module", chunk)


def _sharded_state(model_chunks: list, optimizer, *, is_loading: bool) -> dict:
    model_sd = {}
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        model_sd[key] = _module(chunk).sharded_state_dict()
    state = dict(model_sd)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


_writer_manager = None


def _writer_results_queue_dies_with_us() -> None:
    """Megatron's checkpoint writer keeps a multiprocessing Manager (``filesystem_async.
    _get_write_results_queue``) alive for the life of the process, and every save sends the
    results of its forked writer processes through it. We create that queue ourselves, from a
    Manager that dies with this process (a rank killed with SIGKILL leaves none behind) and that
    survives the stop signals (``lifetime.shielded_helper``): a SIGTERM that reaches every process
    of the rank's group (torchrun's killpg, Slurm's scancel / requeue) must not take the queue
    away from the preemption checkpoint (it did: ``BrokenPipeError``, ``step_N.tmp`` left).
    The Manager's own finalizer shuts it down at exit (a request, then SIGKILL)."""
    global _writer_manager
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_gspo.lifetime import shielded_helper

    if filesystem_async._results_queue is None:
        _writer_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        _writer_manager.start(initializer=shielded_helper)
        filesystem_async._results_queue = _writer_manager.Queue()


_saving = False
"""True while this process writes a checkpoint: the writer processes Megatron forks then are
shielded from the stop signals (``_shield_forked_writer``)."""


def _shield_forked_writer() -> None:
    """``os.register_at_fork(after_in_child=...)``: a writer process forked during a save blocks
    the stop signals, so that a signal to the whole process group lets it finish its shard (the
    rank waits for it and then stops on the same signal)."""
    if _saving:
        from megatron_gspo.lifetime import shield_from_stop_signals

        shield_from_stop_signals()


os.register_at_fork(after_in_child=_shield_forked_writer)


def save_checkpoint(run_dir: str | Path, step: int, model_chunks: list, optimizer,
                    run_state: dict[str, Any], *, scheduler=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory.

    ``scheduler``: the LR schedule, identical on every rank; rank 0 writes its ``state_dict``
    (plain numbers, exact in JSON)."""
    from megatron.core import dist_checkpointing

    _writer_results_queue_dies_with_us()

    root = checkpoint_root(run_dir)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    rank = dist.get_rank()
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "model_optim").mkdir(parents=True)
    dist.barrier()
    global _saving
    _saving = True
    try:
        dist_checkpointing.save(_sharded_state(model_chunks, optimizer, is_loading=False),
                                str(tmp / "model_optim"))
    finally:
        _saving = False
    torch.save(_rng_state(), tmp / f"rank_{rank:05d}.pt")
    if rank == 0:
        if scheduler is not None:
            (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), indent=1))
        (tmp / "run_state.json").write_text(json.dumps({"step": step, **run_state}, indent=1))
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        marker_tmp = root / "latest.tmp"
        marker_tmp.write_text(name)
        os.replace(marker_tmp, root / "latest")
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, model_chunks: list, optimizer, *,
                    restore_rng: bool = True, scheduler=None) -> dict[str, Any]:
    """Collective: load model, optimizer, this rank's RNG and (given ``scheduler``) the LR
    schedule's position; returns the run state (with step)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state_path = path / "run_state.json"
    if not state_path.is_file():
        raise FileNotFoundError(f"{path}: not a checkpoint (no run_state.json)")
    scheduler_path = path / "scheduler.json"
    if scheduler is not None and not scheduler_path.is_file():
        raise FileNotFoundError(f"{scheduler_path}: missing; this checkpoint has no LR schedule "
                                "state to resume from")
    loaded = dist_checkpointing.load(_sharded_state(model_chunks, optimizer, is_loading=True),
                                     str(path / "model_optim"))
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        _module(chunk).load_state_dict(loaded[key], strict=True)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        # After the optimizer (whose state restores the param groups' old lr): the scheduler then
        # sets the lr of the restored position. Megatron's load ADDS the saved step count to the
        # current one, so the position is reset first: loading replaces it.
        scheduler.num_steps = 0
        scheduler.load_state_dict(json.loads(scheduler_path.read_text()))
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if restore_rng and rank_file.is_file():
        _set_rng_state(torch.load(rank_file, weights_only=False))
    return json.loads(state_path.read_text())
