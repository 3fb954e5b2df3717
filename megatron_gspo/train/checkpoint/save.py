"""Writing a checkpoint (:func:`save_checkpoint`): the free-space check, the writer processes
Megatron forks (shielded from the stop signals), the files, the manifest, the atomic rename and
the ``latest`` marker; a failure (a full disk: :class:`CheckpointDiskFull`) is raised on every
rank alike. :func:`rotate_checkpoints` keeps the newest ones.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
from multiprocessing import resource_tracker
from multiprocessing.managers import SyncManager
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_gspo import mcore_compat
from megatron_gspo.collectives import all_gather, broadcast, initialized, on_rank0, rank_world
from megatron_gspo.disk_full import DiskFull, disk_full_message, is_disk_full
from megatron_gspo.lifetime import STOP_SIGNALS, shield_from_stop_signals, shielded_helper
from megatron_gspo.train.checkpoint.manifest import (MANIFEST, MANIFEST_FORMAT, CheckpointError,
                                                     checkpoint_root, describe_files, list_files,
                                                     step_dirs)
from megatron_gspo.train.checkpoint.records import layout_of, model_record, optimizer_record
from megatron_gspo.train.checkpoint.run_state import tensor_bytes, write_run_state
from megatron_gspo.train.checkpoint.state import rng_state, sharded_state, state_bytes


class CheckpointDiskFull(DiskFull):
    """No space left for a checkpoint (errno ENOSPC); the message names the path, the space the
    checkpoint needs and the space free (:mod:`megatron_gspo.disk_full`: the export's is said
    the same way)."""


def _looks_like_failed_write(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(s in text for s in ("inline_container", "file write failed", "PytorchStreamWriter",
                                   "unexpected pos"))


def _disk_full_message(final: Path, where: Path, needed: int, free: int) -> str:
    return disk_full_message("checkpoint", final.name, where, needed, free,
                             "free space there, point run.output_dir at a larger disk, or keep "
                             "fewer checkpoints (run.keep_checkpoints)")


# ------------------------------------------------------------------------------------------------
# Save


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

    if filesystem_async._results_queue is None:
        _writer_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        # the stop signals stay blocked from the fork on: the spawned interpreter inherits the
        # mask, so a signal to the whole group while it starts (before its initializer runs) no
        # longer kills it (the save then failed with EOFError); one that reaches this thread
        # meanwhile is delivered when the mask is restored. multiprocessing's resource tracker
        # starts first: starting itself (the process's first spawn) it UNBLOCKS SIGINT and
        # SIGTERM afterwards, which left the Manager's interpreter unshielded (issue 38 item 1)
        resource_tracker.ensure_running()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            _writer_manager.start(initializer=shielded_helper)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        filesystem_async._results_queue = _writer_manager.Queue()


_saving = False
"""True while this process writes a checkpoint: the writer processes Megatron forks then are
shielded from the stop signals (``_shield_forked_writer``)."""


def _shield_forked_writer() -> None:
    """``os.register_at_fork(after_in_child=...)``: a writer process forked during a save blocks
    the stop signals, so that a signal to the whole process group lets it finish its shard (the
    rank waits for it and then stops on the same signal)."""
    if _saving:
        shield_from_stop_signals()


os.register_at_fork(after_in_child=_shield_forked_writer)


def _prepare(root: Path, final: Path, tmp: Path, needed: int) -> None:
    """Rank 0: a fresh ``tmp`` directory, stale ``.tmp`` directories of interrupted saves gone,
    and enough free space; else :class:`CheckpointDiskFull` or :class:`CheckpointError`."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        free = shutil.disk_usage(root).free
        if free < needed:
            raise CheckpointDiskFull(_disk_full_message(final, tmp, needed, free), tmp)
        (tmp / "model_optim").mkdir(parents=True)
    except CheckpointDiskFull:
        raise
    except OSError as err:
        if is_disk_full(err):
            raise CheckpointDiskFull(_disk_full_message(final, Path(err.filename or tmp), needed,
                                                        shutil.disk_usage(root).free),
                                     tmp) from None
        raise CheckpointError(f"checkpoint {final.name}: cannot create {tmp}: {err}") from None


def _write_error(err: BaseException, final: Path, tmp: Path, needed: int) -> tuple[str, str]:
    """(kind, message) of a failed write: "disk_full" or "error"."""
    root = tmp.parent
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = 0
    if is_disk_full(err) or (_looks_like_failed_write(err) and free < needed):
        where = Path(getattr(err, "filename", None) or tmp)
        return "disk_full", _disk_full_message(final, where, needed, free)
    return "error", f"checkpoint {final.name}: writing {tmp} failed: {type(err).__name__}: {err}"


def _raise_on_every_rank(outcomes: list, final: Path, tmp: Path) -> None:
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return
    kind, message = next((o for o in failed if o[0] == "disk_full"), failed[0])
    if rank_world()[0] == 0:  # every rank is past its writes: the partial save can go
        shutil.rmtree(tmp, ignore_errors=True)
    if initialized():  # and is gone when any rank raises (a caller may look, or retry at once)
        dist.barrier()
    if kind == "disk_full":
        raise CheckpointDiskFull(message, tmp)
    raise CheckpointError(message)


def rotate_checkpoints(run_dir: str | Path, keep: int, *,
                       protect: Sequence[str | Path] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints of a run, never one in ``protect``; returns
    the deleted directories. The ``latest`` marker always names a kept one (the newest)."""
    if keep < 1:
        raise ValueError(f"keep: must be >= 1, got {keep}")
    keep_names = {Path(p).name for p in protect}
    deleted = []
    for path in step_dirs(checkpoint_root(run_dir))[keep:]:
        if path.name not in keep_names:
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


def save_checkpoint(run_dir: str | Path, step: int, model_chunks: list, optimizer,
                    run_state: dict[str, Any], *, scheduler=None, keep: Optional[int] = None,
                    protect: Sequence[str | Path] = (), model_config=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory.

    ``run_state``: rank 0's (the others' is not written): JSON-able values and tensors anywhere
    in it, the tensors into ``run_state.safetensors`` (``run_state.write_run_state``).
    ``scheduler``: the LR schedule, identical on every rank; rank 0 writes its ``state_dict``
    (plain numbers, exact in JSON). ``model_config`` (the run's ModelConfig): recorded in the
    manifest (:func:`model_record`), so that a resume with a changed model is refused before the
    ranks start; the layout is recorded always (:func:`layout_of`). ``keep``: after the save,
    delete all but the newest ``keep`` checkpoints (None: keep all), never those in ``protect``.
    Raises :class:`CheckpointDiskFull` (too little space, checked first, or ENOSPC while writing)
    or :class:`CheckpointError` on every rank alike; a failed save leaves the previous checkpoints
    as they were."""
    _writer_results_queue_dies_with_us()

    root = checkpoint_root(run_dir)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    rank = dist.get_rank()
    layout = layout_of(model_chunks)
    state = sharded_state(model_chunks, optimizer, is_loading=False)
    mine = state_bytes(state) + (tensor_bytes(run_state) if rank == 0 else 0)
    needed = sum(all_gather(mine, None))
    # rank 0 prepares; its error is raised on every rank (also the barrier: the directory exists
    # from here on)
    on_rank0(_prepare, root, final, tmp, needed, group=None)
    global _saving
    error = None
    try:
        _saving = True
        try:
            dist_checkpointing.save(state, str(tmp / "model_optim"))
        finally:
            _saving = False
        torch.save(rng_state(), tmp / f"rank_{rank:05d}.pt")
        if rank == 0:
            if scheduler is not None:
                (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), indent=1))
            write_run_state(tmp, step, run_state)
    except Exception as err:  # noqa: BLE001 - raised on every rank below, with the path
        error = _write_error(err, final, tmp, needed)
    _raise_on_every_rank(all_gather(error, None), final, tmp)
    # every file is written: checksum them (each rank a share), then rank 0 seals the directory
    names = broadcast(list_files(tmp) if rank == 0 else None, None)
    try:
        files, error = describe_files(tmp, names), None
    except OSError as err:
        files, error = {}, _write_error(err, final, tmp, needed)
    _raise_on_every_rank(all_gather(error, None), final, tmp)
    if rank == 0:
        try:
            manifest = {"format": MANIFEST_FORMAT, "step": step, "stack": mcore_compat.stack(),
                        "world_size": dist.get_world_size(), "layout": layout,
                        "optimizer": optimizer_record(optimizer), "files": files}
            if model_config is not None:
                manifest["model"] = model_record(model_config, layout["tensor"])
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            marker_tmp = root / "latest.tmp"
            marker_tmp.write_text(name)
            os.replace(marker_tmp, root / "latest")
            if keep is not None:
                rotate_checkpoints(run_dir, keep, protect=[final, *protect])
        except OSError as err:
            error = _write_error(err, final, tmp, needed)
    _raise_on_every_rank(all_gather(error, None), final, tmp)
    return final
