"""Training checkpoints: model and optimizer (Megatron dist_checkpointing, torch_dist), RNG states,
and the run's own state (step, data position, weight version), saved atomically and verified on
resume.

Layout of ``<run_dir>/checkpoints``::

    step_000012/            one checkpoint (a torch_dist directory written by every rank)
        model_optim/        dist_checkpointing: model + optimizer, layout-independent
        rank_00003.pt       this rank's RNG states (plain tensors and numbers: weights_only)
        scheduler.json      the LR schedule's state (Megatron's OptimizerParamScheduler), rank 0
        run_state.json      step, data sampler position, weight version, ... (rank 0)
        manifest.json       size and sha256 of every other file; written last (rank 0)
    latest                  text file: the name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp``; once every rank has written its part, the ranks
checksum the files (each rank a share of them), rank 0 writes ``manifest.json`` and renames the
directory, then replaces ``latest`` atomically. A rank killed mid-save leaves a ``.tmp`` directory
that resume ignores (and the next save removes). Model and optimizer shards use Megatron's
``sharded_state_dict``, so a checkpoint written under one parallel layout loads under another.

**Resume** (:func:`latest_checkpoint`) takes the newest checkpoint whose every file matches its
manifest (:func:`verify_checkpoint`: sizes, then sha256); a newer one that does not is reported
with the file that is wrong, and the next older one is used. A directory without a manifest is
a partial save and never used. When no checkpoint is intact, :class:`CheckpointError` lists what
is wrong with each. Loading (:func:`load_checkpoint`) needs this rank's RNG file: without it the
resumed run would not draw the same random numbers (an error, never skipped silently).

**What the manifest protects against, and what not.** The manifest catches damage: a truncated
or partly written file, a flipped byte, a missing or extra file, a partial save. It is no
signature: whoever can write the checkpoint can rewrite a file *and* its manifest entry, and
such a checkpoint passes verification. Loading therefore never runs code from it: Megatron's
reader unpickles ``model_optim/.metadata`` and the ``.distcp`` byte items without restriction,
so :func:`load_checkpoint` first vets them (:func:`megatron_gspo.dcp_metadata.check_torch_dist`:
``.metadata`` with an unpickler that resolves only the classes torch's checkpoint metadata is
made of, byte items and ``common.pt`` with torch's ``weights_only`` loader; tensors and the
RNG files are read ``weights_only`` anyway) and refuses a pickle that names anything else with
a :class:`CheckpointError` naming the file, before Megatron reads it. Tampered *values*
(weights, optimizer state, ``run_state.json``) are not detected; resume only from checkpoints
whose directory you trust as you trust your code.

**Disk.** Before writing, rank 0 compares the free space of the checkpoint filesystem with the
bytes this save writes (the main replicas of every rank's shards); too little, or a write that
fails with ENOSPC, is a :class:`CheckpointDiskFull` naming the path, the space needed and the
space free, raised on every rank alike. ``keep`` (``run.keep_checkpoints``) deletes all but the
newest ``keep`` checkpoints after each save, never one in ``protect`` (the one this run resumed
from).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: damaged, partial, or missing a file this run
    needs. The message names the checkpoint and the file."""


class CheckpointDiskFull(OSError):
    """No space left for a checkpoint (errno ENOSPC); the message names the path, the space the
    checkpoint needs and the space free."""

    def __init__(self, message: str, path: str | Path):
        super().__init__(errno.ENOSPC, message, str(path))


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


# ------------------------------------------------------------------------------------------------
# Collectives that also work without torch.distributed (a single process reading checkpoints)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_world(group=None) -> tuple[int, int]:
    if not _dist_on():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(obj, group=None) -> list:
    if not _dist_on():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj, group=None):
    if not _dist_on():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    return box[0]


# ------------------------------------------------------------------------------------------------
# Manifests and verification


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` except the manifest, as sorted relative paths."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.relative_to(directory) != Path(MANIFEST))


def _my_share(names: Sequence[str], group=None) -> list[str]:
    """This rank's share of ``names`` (every world-th one): the ranks checksum in parallel."""
    rank, world = _rank_world(group)
    return [n for i, n in enumerate(names) if i % world == rank]


def _describe(directory: Path, names: Sequence[str], group=None) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of ``names`` under ``directory``; collective (each rank hashes
    its share)."""
    mine = {n: {"size": (directory / n).stat().st_size, "sha256": _sha256(directory / n)}
            for n in _my_share(names, group)}
    out: dict[str, dict] = {}
    for part in _all_gather(mine, group):
        out.update(part)
    return out


def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: partial checkpoint: no {MANIFEST} (its save did not "
                              "finish, or it was written before checkpoints had manifests)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
        for name, entry in files.items():
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"file name {name!r} outside the checkpoint")
            int(entry["size"]), str(entry["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{manifest_path}: damaged manifest ({type(err).__name__}: {err})"
                              ) from None
    return manifest


def _problems(path: Path, files: dict, names: Iterable[str]) -> list[str]:
    problems = []
    for name in names:
        want = files[name]
        target = path / name
        try:
            size = target.stat().st_size
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != int(want["size"]):
            problems.append(f"{name}: {size} bytes, the manifest says {want['size']}")
        elif _sha256(target) != want["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest (damaged contents)")
    return problems


_verified: set[tuple[str, int]] = set()
"""(checkpoint, manifest mtime) found intact by this process: ``load_checkpoint`` of the one
``latest_checkpoint`` just chose does not read every file a second time."""


def _verified_key(path: Path) -> Optional[tuple[str, int]]:
    try:
        return str(path.resolve()), (path / MANIFEST).stat().st_mtime_ns
    except OSError:
        return None


def verify_checkpoint(path: str | Path, *, group=None) -> list[str]:
    """What is wrong with the checkpoint ``path`` (empty: intact): a missing or damaged manifest,
    and every file whose size or sha256 differs from it, by name. Collective when
    torch.distributed is initialised (each rank checks a share of the files), local otherwise."""
    path = Path(path)
    try:
        files = _read_manifest(path)["files"]
    except CheckpointError as err:
        problems = [str(err)]
    else:
        problems = _problems(path, files, _my_share(sorted(files), group))
    merged: list[str] = []
    for part in _all_gather(problems, group):
        merged += [p for p in part if p not in merged]
    key = _verified_key(path)
    if not merged and key is not None:
        _verified.add(key)
    return merged


def _candidates(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest step first (``.tmp`` ones excluded)."""
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def _say(message: str) -> None:
    if _rank_world()[0] == 0:
        print(message, file=sys.stderr, flush=True)


def latest_checkpoint(run_dir: str | Path, *, group=None) -> Optional[Path]:
    """The newest intact checkpoint of a run, or None when the run has none.

    Checkpoints are tried newest first; one that fails :func:`verify_checkpoint` is reported (on
    stderr, naming the damaged file) and the next older one is tried. Raises
    :class:`CheckpointError` when there are checkpoints but none is intact. Collective when
    torch.distributed is initialised (every rank calls it)."""
    root = checkpoint_root(run_dir)
    candidates = _candidates(root)
    if not candidates:
        return None
    marker = root / "latest"
    named = marker.read_text().strip() if marker.is_file() else None
    damaged: list[str] = []
    for path in candidates:
        problems = verify_checkpoint(path, group=group)
        if not problems:
            if damaged:
                _say("resume: " + "; ".join(damaged) + f"; resuming from {path} instead "
                     "(the newest intact checkpoint)")
            elif named is not None and named != path.name:
                _say(f"resume: {marker} names {named}, but {path.name} is newer and intact "
                     f"(a save ended before updating the marker); resuming from {path}")
            return path
        damaged.append(f"checkpoint {path} is damaged ({'; '.join(problems[:5])}"
                       + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "") + ")")
    raise CheckpointError("no intact checkpoint to resume from: " + "; ".join(damaged)
                          + f". Remove the damaged directories from {root} to start over")


# ------------------------------------------------------------------------------------------------
# RNG states (plain tensors and numbers, so that loading them needs no pickle: weights_only)


def _rng_state() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    bit_generator, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                        "gauss": gauss},
             "numpy": {"bit_generator": bit_generator,
                       "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["bit_generator"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
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


def _state_bytes(state) -> int:
    """Bytes this rank writes for ``state``: the main replicas of its sharded tensors (and of the
    tensors its factories shard); pickled objects and metadata come on top (small)."""
    from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                          is_main_replica)

    total = 0
    todo = [state]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, (ShardedTensor, ShardedTensorFactory)):
            data = item.data
            if isinstance(data, torch.Tensor) and is_main_replica(item.replica_id):
                total += data.numel() * data.element_size()
    return total


# ------------------------------------------------------------------------------------------------
# Disk space


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _is_disk_full(err: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in ``err``'s chain (torch.distributed.checkpoint wraps the writers'
    errors; torch.save reports a full disk as a failed write of its zip container)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch DCP's CheckpointException
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value if isinstance(value, BaseException)
                            else getattr(value, "exc", None))
    return False


def _looks_like_failed_write(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(s in text for s in ("inline_container", "file write failed", "PytorchStreamWriter",
                                   "unexpected pos"))


def _disk_full_message(final: Path, where: Path, needed: int, free: int) -> str:
    return (f"checkpoint {final.name}: no space left on device writing {where}: this "
            f"checkpoint needs about {_mib(needed)}, {_mib(free)} free on that filesystem; free "
            "space there, point run.output_dir at a larger disk, or keep fewer checkpoints "
            "(run.keep_checkpoints)")


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


def _prepare(root: Path, final: Path, tmp: Path, needed: int) -> Optional[str]:
    """Rank 0: a fresh ``tmp`` directory, stale ``.tmp`` directories of interrupted saves gone,
    and enough free space; returns what is wrong, or None."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        free = shutil.disk_usage(root).free
        if free < needed:
            return _disk_full_message(final, tmp, needed, free)
        (tmp / "model_optim").mkdir(parents=True)
    except OSError as err:
        if _is_disk_full(err):
            return _disk_full_message(final, Path(err.filename or tmp), needed,
                                      shutil.disk_usage(root).free)
        return f"checkpoint {final.name}: cannot create {tmp}: {err}"
    return None


def _write_error(err: BaseException, final: Path, tmp: Path, needed: int) -> tuple[str, str]:
    """(kind, message) of a failed write: "disk_full" or "error"."""
    root = tmp.parent
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        free = 0
    if _is_disk_full(err) or (_looks_like_failed_write(err) and free < needed):
        where = Path(getattr(err, "filename", None) or tmp)
        return "disk_full", _disk_full_message(final, where, needed, free)
    return "error", f"checkpoint {final.name}: writing {tmp} failed: {type(err).__name__}: {err}"


def _raise_on_every_rank(outcomes: list, final: Path, tmp: Path) -> None:
    failed = [o for o in outcomes if o is not None]
    if not failed:
        return
    kind, message = next((o for o in failed if o[0] == "disk_full"), failed[0])
    if _rank_world()[0] == 0:  # every rank is past its writes: the partial save can go
        shutil.rmtree(tmp, ignore_errors=True)
    if _dist_on():  # and is gone when any rank raises (a caller may look, or retry at once)
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
    for path in _candidates(checkpoint_root(run_dir))[keep:]:
        if path.name not in keep_names:
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


def save_checkpoint(run_dir: str | Path, step: int, model_chunks: list, optimizer,
                    run_state: dict[str, Any], *, scheduler=None, keep: Optional[int] = None,
                    protect: Sequence[str | Path] = ()) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory.

    ``scheduler``: the LR schedule, identical on every rank; rank 0 writes its ``state_dict``
    (plain numbers, exact in JSON). ``keep``: after the save, delete all but the newest ``keep``
    checkpoints (None: keep all), never those in ``protect``. Raises :class:`CheckpointDiskFull`
    (too little space, checked first, or ENOSPC while writing) or :class:`CheckpointError` on
    every rank alike; a failed save leaves the previous checkpoints as they were."""
    from megatron.core import dist_checkpointing

    _writer_results_queue_dies_with_us()

    root = checkpoint_root(run_dir)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    rank = dist.get_rank()
    state = _sharded_state(model_chunks, optimizer, is_loading=False)
    needed = sum(_all_gather(_state_bytes(state)))
    problem = _prepare(root, final, tmp, needed) if rank == 0 else None
    problem = _broadcast(problem)  # also the barrier: the directory exists from here on
    if problem is not None:
        raise CheckpointDiskFull(problem, tmp) if "no space left" in problem \
            else CheckpointError(problem)
    global _saving
    error = None
    try:
        _saving = True
        try:
            dist_checkpointing.save(state, str(tmp / "model_optim"))
        finally:
            _saving = False
        torch.save(_rng_state(), tmp / f"rank_{rank:05d}.pt")
        if rank == 0:
            if scheduler is not None:
                (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict(), indent=1))
            (tmp / "run_state.json").write_text(json.dumps({"step": step, **run_state}, indent=1))
    except Exception as err:  # noqa: BLE001 - raised on every rank below, with the path
        error = _write_error(err, final, tmp, needed)
    _raise_on_every_rank(_all_gather(error), final, tmp)
    # every file is written: checksum them (each rank a share), then rank 0 seals the directory
    names = _broadcast(_files(tmp) if rank == 0 else None)
    try:
        files, error = _describe(tmp, names), None
    except OSError as err:
        files, error = {}, _write_error(err, final, tmp, needed)
    _raise_on_every_rank(_all_gather(error), final, tmp)
    if rank == 0:
        try:
            manifest = {"format": MANIFEST_FORMAT, "step": step,
                        "world_size": dist.get_world_size(), "files": files}
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
    _raise_on_every_rank(_all_gather(error), final, tmp)
    return final


# ------------------------------------------------------------------------------------------------
# Load


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None


def load_checkpoint(path: str | Path, model_chunks: list, optimizer, *,
                    restore_rng: bool = True, scheduler=None) -> dict[str, Any]:
    """Collective: load model, optimizer, this rank's RNG and (given ``scheduler``) the LR
    schedule's position; returns the run state (with step).

    The checkpoint is verified first (:func:`verify_checkpoint`); a damaged or partial one is a
    :class:`CheckpointError` naming the file, as is a missing RNG file of this rank when
    ``restore_rng`` (a checkpoint written by fewer ranks than this run has: the resume would
    not be exact)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    # Every rank passes the same path, so every rank takes the same branch (verification is
    # collective).
    problems = [] if _verified_key(path) in _verified else verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems[:10]))
    manifest = _read_manifest(path)
    state_path = path / "run_state.json"
    if "run_state.json" not in manifest["files"]:
        raise CheckpointError(f"{path}: not a training checkpoint (no run_state.json)")
    scheduler_path = path / "scheduler.json"
    if scheduler is not None and "scheduler.json" not in manifest["files"]:
        raise CheckpointError(f"{scheduler_path}: missing; this checkpoint has no LR schedule "
                              "state to resume from")
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if restore_rng and rank_file.name not in manifest["files"]:
        raise CheckpointError(
            f"{rank_file}: missing: the checkpoint holds the RNG states of "
            f"{manifest.get('world_size', '?')} ranks and this run has {dist.get_world_size()}; "
            "without this rank's states the resumed run would not draw the random numbers the "
            "uninterrupted run would have")
    # Megatron unpickles .metadata and the byte items without restriction: vet them first
    # (allow-listed metadata classes, weights_only byte items); a refusal names the file
    from megatron_gspo.dcp_metadata import UnsafeCheckpointError, check_torch_dist

    try:
        check_torch_dist(path / "model_optim")
    except (UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(f"checkpoint {path} refused: {err}") from None
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
        scheduler.load_state_dict(_read_json(scheduler_path))
    if restore_rng:
        try:
            rng = torch.load(rank_file, weights_only=True)
        except Exception as err:  # noqa: BLE001 - the file matched its checksum: a format issue
            raise CheckpointError(f"{rank_file}: unreadable RNG states ({type(err).__name__}: "
                                  f"{err})") from None
        _set_rng_state(rng)
    return _read_json(state_path)


class CheckpointedTrainer:
    """``save`` / ``load`` for a trainer with a ``TrainState`` (``self.state``) and a config
    (``self.cfg``): model, optimizer, LR schedule, RNG and the caller's run state. Shared by the RL
    and SFT trainers; ``resumed_from`` remembers the checkpoint a run resumed from, which
    ``run.keep_checkpoints`` rotation must never delete."""

    resumed_from: Optional[Path] = None

    def save(self, run_dir: str | Path, step: int, run_state: dict) -> Path:
        """Collective: checkpoint after ``step``."""
        return save_checkpoint(run_dir, step, self.state.model, self.state.optimizer, run_state,
                               scheduler=self.state.scheduler, keep=self.cfg.run.keep_checkpoints,
                               protect=[self.resumed_from] if self.resumed_from else [])

    def load(self, path: str | Path) -> dict:
        """Collective: restore a checkpoint written by :meth:`save`; returns its run state."""
        run_state = load_checkpoint(path, self.state.model, self.state.optimizer,
                                    scheduler=self.state.scheduler)
        self.resumed_from = Path(path)
        return run_state
