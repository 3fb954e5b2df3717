"""Training checkpoints: model and optimizer (Megatron dist_checkpointing, torch_dist), RNG states,
and the run's own state (step, data position, weight version), saved atomically and verified on
resume.

Layout of ``<run_dir>/checkpoints``::

    step_000012/            one checkpoint (a torch_dist directory written by every rank)
        model_optim/        dist_checkpointing: model + optimizer, layout-independent
        rank_00003.pt       this rank's RNG states (plain tensors and numbers: weights_only)
        scheduler.json      the LR schedule's state (Megatron's OptimizerParamScheduler), rank 0
        run_state.json      step, data sampler position, weight version, ... (rank 0)
        manifest.json       size and sha256 of every other file, the stack that wrote it
                            (megatron-core, torch, Python), the parallel layout and the model
                            config it was written under; written last (rank 0)
    latest                  text file: the name of the newest complete checkpoint

A checkpoint is written into ``step_N.tmp``; once every rank has written its part, the ranks
checksum the files (each rank those it wrote itself, still in its page cache: :func:`_my_share`),
rank 0 writes ``manifest.json`` and renames the
directory, then replaces ``latest`` atomically. A rank killed mid-save leaves a ``.tmp`` directory
that resume ignores (and the next save removes). Model and optimizer shards use Megatron's
``sharded_state_dict``, so a checkpoint written under one parallel layout loads under another.

**Resume** (:func:`latest_checkpoint`) takes the newest checkpoint whose every file matches its
manifest (:func:`verify_checkpoint`: sizes, then sha256); a newer one that does not is reported
with the file that is wrong, and the next older one is used. A directory without a manifest is
a partial save and never used. When no checkpoint is intact, :class:`CheckpointError` lists what
is wrong with each. Loading (:func:`load_checkpoint`) under the layout that wrote the checkpoint
needs this rank's RNG file: without it the resumed run would not draw the same random numbers (an
error, never skipped silently).

**Resume under another parallel layout.** The manifest records the layout (tensor, pipeline,
expert, expert_tensor, context, data, world size; :func:`layout_of`) and the model config. A
checkpoint resumes under another layout: dist_checkpointing stores global tensors, so the model
and the Adam moments reshard, the step count and the LR schedule are layout-free. Megatron's own
optimizer state dict is not: its nesting follows the layout (one sub-optimizer per expert-parallel
group, ``chained_<i>.`` key prefixes, per-sub-optimizer param groups), so loading it under another
layout fails with a ``KeyError``; :func:`load_checkpoint` then builds this layout's optimizer
state dict, maps every tensor to the key the checkpoint stored it under, and takes the step count
and the param groups' settings from the checkpoint (:func:`_load_resharded`). Per-rank RNG states
do not map to another world: they start fresh (the seeded initialisation of this run), said in
one line. Nothing the training computes draws from them: dropout is 0, every sampling order comes
from a generator seeded by (run.seed, step or epoch), the data position is in ``run_state.json``.
Under the layout that wrote it a checkpoint loads exactly as before (Megatron's state dict, RNG
restored, a missing RNG file an error). A changed MODEL cannot resume (:func:`model_changes`:
any field that changes the parameters' shapes or meaning; the launcher refuses it before the
ranks start, launch/preflight.py).

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

import dataclasses
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

from megatron_gspo import mcore_compat
from megatron_gspo.errors import InputError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError, InputError):
    """A checkpoint that cannot be resumed from: damaged, partial, or missing a file this run
    needs. The message names the checkpoint and the file."""


class CheckpointDiskFull(OSError):
    """No space left for a checkpoint (errno ENOSPC); the message names the path, the space the
    checkpoint needs and the space free."""

    def __init__(self, message: str, path: str | Path):
        super().__init__(errno.ENOSPC, message, str(path))

    def __reduce__(self):  # pickled as it is built (it crosses ranks: megatron_gspo.collectives)
        return type(self), (self.strerror, self.filename), self.__dict__


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


_WRITTEN_BY = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")
"""The files one rank writes: torch DCP's ``__<rank>_<n>.distcp`` data files (the bulk of a
checkpoint: every rank's shards of the model and the optimizer) and this module's RNG files."""

HASH_THREADS = 4
"""Files one rank hashes at once (hashlib releases the GIL on large buffers)."""


def writer_rank(name: str) -> Optional[int]:
    """The rank that wrote checkpoint file ``name`` (None: rank 0's small metadata files)."""
    m = _WRITTEN_BY.search(name)
    return None if m is None else int(m.group(1) or m.group(2))


def _my_share(names: Sequence[str], group=None) -> list[str]:
    """This rank's share of ``names``: each file goes to the rank that wrote it (modulo the world
    size, for a checkpoint of a larger world), the metadata files to rank 0. Right after a save
    a rank then hashes only bytes it has just written, still in its node's page cache: no file
    is read back over the network (with every world-th file, nearly every byte of a 430 GB
    checkpoint would have been read back from another node's writes)."""
    rank, world = _rank_world(group)
    return [n for n in names if (writer_rank(n) or 0) % world == rank]


def _describe(directory: Path, names: Sequence[str], group=None) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of ``names`` under ``directory``; collective (each rank hashes
    its share, :data:`HASH_THREADS` files at a time)."""
    share = _my_share(names, group)
    digests = _threaded(lambda n: _sha256(directory / n), share)
    mine = {n: {"size": (directory / n).stat().st_size, "sha256": d}
            for n, d in zip(share, digests)}
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
    """What is wrong with ``names`` (sizes first, then sha256, :data:`HASH_THREADS` at a time)."""

    def check(name: str) -> Optional[str]:
        want = files[name]
        target = path / name
        try:
            size = target.stat().st_size
        except OSError:
            return f"{name}: missing"
        if size != int(want["size"]):
            return f"{name}: {size} bytes, the manifest says {want['size']}"
        if _sha256(target) != want["sha256"]:
            return f"{name}: sha256 differs from the manifest (damaged contents)"
        return None

    return [p for p in _threaded(check, list(names)) if p is not None]


def _threaded(fn, items: list) -> list:
    """``[fn(x) for x in items]``, :data:`HASH_THREADS` at a time (file hashing releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(items)))) as pool:
        return list(pool.map(fn, items))


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
# The parallel layout and the model a checkpoint was written under (recorded in its manifest)


def layout_of(model_chunks: list) -> dict[str, Any]:
    """This run's parallel layout as a manifest records it: the degrees of the model's Megatron
    config, the data parallelism they leave over, the world size and uneven pipeline stages.
    Sequence parallelism is no part of it (it shards activations, not parameters or state)."""
    tcfg = _module(model_chunks[0]).config
    world = _rank_world()[1]
    tp, pp, cp = (tcfg.tensor_model_parallel_size, tcfg.pipeline_model_parallel_size,
                  tcfg.context_parallel_size)
    return {"world_size": world, "tensor": tp, "pipeline": pp, "context": cp,
            "expert": tcfg.expert_model_parallel_size,
            "expert_tensor": tcfg.expert_tensor_parallel_size or tp,
            "data": world // (tp * pp * cp),
            "num_layers_in_first_pipeline_stage": tcfg.num_layers_in_first_pipeline_stage,
            "num_layers_in_last_pipeline_stage": tcfg.num_layers_in_last_pipeline_stage}


def describe_layout(layout: Optional[dict], world_size: Any = "?") -> str:
    """``tensor 1, pipeline 1, expert 2, expert_tensor 1, context 1, data 2 (2 ranks)``."""
    if not isinstance(layout, dict):
        return f"an unrecorded layout of {world_size} ranks"
    text = ", ".join(f"{k} {layout.get(k, '?')}" for k in
                     ("tensor", "pipeline", "expert", "expert_tensor", "context", "data"))
    for stage in ("first", "last"):
        layers = layout.get(f"num_layers_in_{stage}_pipeline_stage")
        if layers is not None:
            text += f", {layers} layers in the {stage} stage"
    ranks = layout.get("world_size", world_size)
    return f"{text} ({ranks} rank{'' if ranks == 1 else 's'})"


RESUMABLE_MODEL_FIELDS = frozenset({
    # how the same function is computed: kernels, dispatch, recompute, router precision
    "moe_token_dispatcher", "moe_router_dtype", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_modules", "moe_permute_fusion",
    "gradient_accumulation_fusion", "apply_rope_fusion",
    # read only at initialisation (a resumed run loads its weights), or a training coefficient
    "init_method_std", "moe_aux_loss_coeff",
    # a limit on positions (RoPE: no parameter depends on it)
    "max_position_embeddings",
    # compared through what it decides, the padded vocabulary (the embedding's rows)
    "make_vocab_size_divisible_by",
})
"""ModelConfig fields a resumed run may change. Every other field (sizes, heads, head_dim,
experts, top-k, vocabulary, tied embeddings, RoPE theta, norm epsilon, parameter dtype, and any
field added later) is the model itself: a checkpoint written with another value cannot resume."""


def model_record(model, tensor_parallel: int) -> dict[str, Any]:
    """The manifest's record of ``model`` (a ModelConfig): every field, and the vocabulary padded
    for ``tensor_parallel`` (the embedding's and output layer's rows)."""
    from megatron_gspo.config import padded_vocab_size

    record = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
    record = json.loads(json.dumps(record))  # as the manifest stores it (lists, floats)
    record["padded_vocab_size"] = padded_vocab_size(model, tensor_parallel)
    return record


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def model_changes(record: dict, model) -> list[tuple[str, Any, Any]]:
    """``(field, written, now)`` for every field of ``model`` that differs from a checkpoint's
    :func:`model_record` and is not in :data:`RESUMABLE_MODEL_FIELDS` (fields the record lacks,
    e.g. added after it was written, are not compared)."""
    now = model_record(model, 1)
    return [(name, record[name], now[name]) for name in now
            if name != "padded_vocab_size" and name not in RESUMABLE_MODEL_FIELDS
            and name in record and record[name] != now[name]]


def resume_refusal(path: str | Path, manifest: dict, model, tensor_parallel: int) -> Optional[str]:
    """Why the checkpoint ``path`` (its ``manifest``) cannot resume a run of ``model`` under
    ``tensor_parallel``, in one message, or None. A checkpoint without a model record (written
    before checkpoints had one) is not judged here."""
    record = manifest.get("model")
    if not isinstance(record, dict):
        return None
    changes = model_changes(record, model)
    if changes:
        if len(changes) == 1:
            name, written, now = changes[0]
            what = f"model.{name}={_show(written)}; this config has {_show(now)}"
        else:
            what = (" and ".join(f"model.{n}={_show(w)}" for n, w, _ in changes)
                    + "; this config has " + " and ".join(f"model.{n}={_show(v)}"
                                                          for n, _, v in changes))
        return (f"--resume: checkpoint {path} was written with {what}: a changed model cannot "
                "resume (start a new run, or init from the exported hf/ policy: run.init_from)")
    from megatron_gspo.config import padded_vocab_size

    rows, now_rows = record.get("padded_vocab_size"), padded_vocab_size(model, tensor_parallel)
    if rows is None or rows == now_rows:
        return None
    written_tp = (manifest.get("layout") or {}).get("tensor", "?")
    hint = ""
    written_divisor = record.get("make_vocab_size_divisible_by")
    for divisor in ((written_divisor * written_tp if isinstance(written_tp, int)
                     and isinstance(written_divisor, int) else 0), rows):
        if divisor and divisor % tensor_parallel == 0:
            candidate = dataclasses.replace(model, make_vocab_size_divisible_by=divisor
                                            // tensor_parallel)
            if padded_vocab_size(candidate, tensor_parallel) == rows:
                hint = (f"; set model.make_vocab_size_divisible_by: "
                        f"{divisor // tensor_parallel} to keep {rows} rows")
                break
    return (f"--resume: checkpoint {path} holds a vocabulary padded to {rows} rows "
            f"(model.make_vocab_size_divisible_by {written_divisor} x "
            f"parallel.tensor {written_tp}); this config pads it to {now_rows} "
            f"(model.make_vocab_size_divisible_by {model.make_vocab_size_divisible_by} x "
            f"parallel.tensor {tensor_parallel}): the embedding and output layer would not fit"
            + hint)


def resume_candidate(run_dir: str | Path) -> Optional[tuple[Path, dict]]:
    """(checkpoint, manifest) that ``--resume`` would start from, judged cheaply (no checksums:
    the ranks verify): the newest checkpoint whose manifest reads; None when there is none."""
    for path in _candidates(checkpoint_root(run_dir)):
        try:
            return path, _read_manifest(path)
        except CheckpointError:
            continue
    return None


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
                    protect: Sequence[str | Path] = (), model_config=None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory.

    ``scheduler``: the LR schedule, identical on every rank; rank 0 writes its ``state_dict``
    (plain numbers, exact in JSON). ``model_config`` (the run's ModelConfig): recorded in the
    manifest (:func:`model_record`), so that a resume with a changed model is refused before the
    ranks start; the layout is recorded always (:func:`layout_of`). ``keep``: after the save,
    delete all but the newest ``keep`` checkpoints (None: keep all), never those in ``protect``.
    Raises :class:`CheckpointDiskFull` (too little space, checked first, or ENOSPC while writing)
    or :class:`CheckpointError` on every rank alike; a failed save leaves the previous checkpoints
    as they were."""
    from megatron.core import dist_checkpointing

    _writer_results_queue_dies_with_us()

    root = checkpoint_root(run_dir)
    name = f"step_{step:06d}"
    final, tmp = root / name, root / f"{name}.tmp"
    rank = dist.get_rank()
    layout = layout_of(model_chunks)
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
            manifest = {"format": MANIFEST_FORMAT, "step": step, "stack": mcore_compat.stack(),
                        "world_size": dist.get_world_size(), "layout": layout, "files": files}
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
    _raise_on_every_rank(_all_gather(error), final, tmp)
    return final


# ------------------------------------------------------------------------------------------------
# Load


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None


_RESHARDED = "optimizer_resharded"
"""Where :func:`_load_resharded` puts this layout's optimizer tensors in the state it loads (a
key of its own: the checkpoint's common state keeps its ``optimizer`` entry, in the writer's
nesting)."""
_CHAINED_PREFIX = re.compile(r"^chained_\d+\.")
"""The prefix ChainedOptimizer puts on its sub-optimizers' tensor keys (the sub-optimizer's
index: which one holds a parameter depends on the layout, e.g. expert weights have their own with
EP > 1)."""


def _sharded_leaves(tree) -> list:
    """The ShardedBase leaves of a nested dict / list, in a fixed order (``_with_leaves``'s)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _sharded_leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in _sharded_leaves(value)]
    return [tree] if isinstance(tree, ShardedBase) else []


def _with_leaves(tree, leaves):
    """``tree`` with its ShardedBase leaves replaced by ``next(leaves)`` (in ``_sharded_leaves``'s
    order) and its LocalNonpersistentObjects unwrapped: a plain state dict."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    if isinstance(tree, dict):
        return {key: _with_leaves(value, leaves) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_with_leaves(value, leaves) for value in tree]
    if isinstance(tree, tuple):
        return tuple(_with_leaves(value, leaves) for value in tree)
    if isinstance(tree, ShardedBase):
        return next(leaves)
    if isinstance(tree, LocalNonpersistentObject):
        return tree.unwrap()
    return tree


def _optimizer_dicts(tree) -> list[dict]:
    """The torch-style optimizer state dicts (those with ``param_groups``) inside a Megatron
    optimizer's state dict: the dict itself (FP32), its ``optimizer`` entry (mixed precision,
    distributed), one per sub-optimizer of a ChainedOptimizer."""
    if not isinstance(tree, dict):
        return []
    if isinstance(tree.get("param_groups"), list):
        return [tree]
    return [d for value in tree.values() for d in _optimizer_dicts(value)]


def _group_id(group: dict, keys: Sequence[str]) -> tuple:
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)


def _carry_over(current: dict, written: Any) -> None:
    """Into ``current`` (this layout's optimizer state dict): the step count and the param-group
    settings (betas, eps, ...; the LR schedule sets lr and weight decay after the load) of the
    checkpoint's common optimizer state ``written``, whatever its nesting. Param groups match by
    Megatron's identifiers (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr); a group whose
    expert-parallel flag has no counterpart (expert weights are a group of their own only with
    EP > 1) takes the settings of the one that matches the rest."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as ids

    written_dicts = _optimizer_dicts(written)
    groups = [g for d in written_dicts for g in d["param_groups"]]
    steps = [d["state"]["common_step"] for d in written_dicts
             if isinstance(d.get("state"), dict) and "common_step" in d["state"]]
    steps += [g["step"] for g in groups if g.get("step") is not None]
    step = steps[0] if steps else None
    loose = [k for k in ids if k != "is_expert_parallel"]
    own = {"params", *ids, *(f"pre_{k}" for k in ids)}  # what this layout's group keeps
    for d in _optimizer_dicts(current):
        for group in d["param_groups"]:
            match = (next((g for g in groups if _group_id(g, ids) == _group_id(group, ids)), None)
                     or next((g for g in groups if _group_id(g, loose) == _group_id(group, loose)),
                             None))
            if match is not None:
                group.update({k: v for k, v in match.items() if k not in own})
            if step is not None and "step" in group:  # the distributed optimizer's place
                number = step.item() if isinstance(step, torch.Tensor) else step
                group["step"] = int(number) if isinstance(group["step"], int) else float(number)
        if step is not None and isinstance(d.get("state"), dict):  # FP32 / mixed precision
            d["state"]["common_step"] = (step.clone() if isinstance(step, torch.Tensor)
                                         else torch.tensor(float(step)))


def _load_resharded(path: Path, state: dict, optimizer, load_kwargs: dict) -> dict:
    """Load ``state`` (this layout's :func:`_sharded_state`) from a checkpoint written under
    another layout; the optimizer's state is loaded into ``optimizer`` here, the returned dict
    holds the model chunks' state.

    The optimizer's tensors are this layout's (Megatron's ``sharded_state_dict`` of this
    optimizer: Adam moments, main params, by model parameter); each is requested under the key
    the checkpoint stored it under (the same key but for the sub-optimizer prefix, looked up in
    the checkpoint's tensor metadata). The step count and the param groups' settings come from the
    checkpoint's common state (:func:`_carry_over`), in whatever nesting the writer had."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing

    request = {key: value for key, value in state.items() if key != "optimizer"}
    leaves = []
    if optimizer is not None:
        saved = {}
        for key in dist_checkpointing.load_tensors_metadata(str(path / "model_optim")):
            rest = _CHAINED_PREFIX.sub("", key, count=1)
            saved.setdefault(rest, key[: len(key) - len(rest)])
        leaves = _sharded_leaves(state["optimizer"])
        renamed = {}
        for i, leaf in enumerate(leaves):
            rest = _CHAINED_PREFIX.sub("", leaf.key, count=1)
            prefix = saved.get(rest)
            if prefix is None:  # a factory's key: the checkpoint holds what it was built into
                prefix = next((saved[k] for k in saved if k.startswith(rest)), None)
            if prefix is None:
                raise CheckpointError(f"checkpoint {path}: no optimizer state for {rest} (saved "
                                      "without an optimizer, or by another model)")
            renamed[str(i)] = replace(leaf, key=prefix + rest)
        request[_RESHARDED] = renamed
    loaded = dist_checkpointing.load(request, str(path / "model_optim"), **load_kwargs)
    if optimizer is not None:
        tensors = iter(loaded[_RESHARDED][str(i)] for i in range(len(leaves)))
        optimizer_state = _with_leaves(state["optimizer"], tensors)
        _carry_over(optimizer_state, loaded.get("optimizer"))
        optimizer.load_state_dict(optimizer_state)
    return loaded


def _layout_changed(path: Path, manifest: dict, layout: dict, state: dict) -> bool:
    """Whether the checkpoint was written under another layout than ``layout``. Checkpoints
    without a layout record (written before manifests had one): when the world size differs, or
    when any rank's optimizer tensors are missing from the checkpoint under their keys (the
    sub-optimizer nesting differs); collective."""
    written = manifest.get("layout")
    if isinstance(written, dict):
        return written != layout
    if manifest.get("world_size", layout["world_size"]) != layout["world_size"]:
        return True
    if "optimizer" not in state:
        return False
    from megatron.core import dist_checkpointing

    saved = set(dist_checkpointing.load_tensors_metadata(str(path / "model_optim")))
    missing = any(leaf.key not in saved and not any(k.startswith(leaf.key) for k in saved)
                  for leaf in _sharded_leaves(state["optimizer"]))
    return any(_all_gather(missing))


def load_checkpoint(path: str | Path, model_chunks: list, optimizer, *,
                    restore_rng: bool = True, scheduler=None,
                    model_config=None) -> dict[str, Any]:
    """Collective: load model, optimizer, this rank's RNG and (given ``scheduler``) the LR
    schedule's position; returns the run state (with step).

    The checkpoint is verified first (:func:`verify_checkpoint`); a damaged or partial one is a
    :class:`CheckpointError` naming the file, as is a missing RNG file of this rank when
    ``restore_rng`` under the layout that wrote it (the resume would not be exact).
    ``model_config`` (this run's ModelConfig): a checkpoint of another model is a
    :class:`CheckpointError` naming the fields (:func:`resume_refusal`). A checkpoint written
    under another parallel layout is resharded (the module docstring); the RNG states then start
    fresh, said in one line."""
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
    layout = layout_of(model_chunks)
    if model_config is not None:
        refusal = resume_refusal(path, manifest, model_config, layout["tensor"])
        if refusal is not None:
            raise CheckpointError(refusal)
    scheduler_path = path / "scheduler.json"
    if scheduler is not None and "scheduler.json" not in manifest["files"]:
        raise CheckpointError(f"{scheduler_path}: missing; this checkpoint has no LR schedule "
                              "state to resume from")
    # Megatron unpickles .metadata and the byte items without restriction: vet them first
    # (allow-listed metadata classes, weights_only byte items); a refusal names the file
    from megatron_gspo.dcp_metadata import UnsafeCheckpointError, check_torch_dist

    try:
        check_torch_dist(path / "model_optim")
    except (UnsafeCheckpointError, OSError) as err:
        raise CheckpointError(f"checkpoint {path} refused: {err}") from None
    state = _sharded_state(model_chunks, optimizer, is_loading=True)
    resharding = _layout_changed(path, manifest, layout, state)
    rank_file = path / f"rank_{dist.get_rank():05d}.pt"
    if restore_rng and not resharding and rank_file.name not in manifest["files"]:
        raise CheckpointError(
            f"{rank_file}: missing: the checkpoint holds the RNG states of "
            f"{manifest.get('world_size', '?')} ranks and this run has {dist.get_world_size()}; "
            "without this rank's states the resumed run would not draw the random numbers the "
            "uninterrupted run would have")
    if resharding:
        _say(f"resume: {path.name} (step {manifest.get('step', '?')}) was written under layout "
             f"{describe_layout(manifest.get('layout'), manifest.get('world_size', '?'))}; "
             f"resuming it under layout {describe_layout(layout)}: model and optimizer state "
             "resharded, the RNG streams start fresh (per-rank states do not map to another "
             "layout; dropout is 0 and the data position is in run_state.json)")
    stack = manifest.get("stack")  # absent in checkpoints of earlier versions of this project
    written_by = stack.get("megatron_core") if isinstance(stack, dict) else None
    running = mcore_compat.stack()["megatron_core"]
    load_kwargs = mcore_compat.dist_load_kwargs(path / "model_optim")
    try:
        if resharding:
            loaded = _load_resharded(path, state, optimizer, load_kwargs)
        else:
            loaded = dist_checkpointing.load(state, str(path / "model_optim"), **load_kwargs)
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with both versions when they differ
        if written_by is None or written_by == running:
            raise
        raise CheckpointError(
            f"checkpoint {path} was written with megatron-core {written_by} and does not load "
            f"with megatron-core {running} ({type(err).__name__}: {str(err)[:300]}); resume it "
            f"on the stack that wrote it (megatron_gspo/mcore_compat.py)") from err
    for i, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{i}"
        _module(chunk).load_state_dict(loaded[key], strict=True)
    if optimizer is not None and not resharding:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None:
        # After the optimizer (whose state restores the param groups' old lr): the scheduler then
        # sets the lr of the restored position. Megatron's load ADDS the saved step count to the
        # current one, so the position is reset first: loading replaces it.
        scheduler.num_steps = 0
        scheduler.load_state_dict(_read_json(scheduler_path))
    if restore_rng and not resharding:
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
                               protect=[self.resumed_from] if self.resumed_from else [],
                               model_config=self.cfg.model)

    def load(self, path: str | Path) -> dict:
        """Collective: restore a checkpoint written by :meth:`save`; returns its run state."""
        run_state = load_checkpoint(path, self.state.model, self.state.optimizer,
                                    scheduler=self.state.scheduler, model_config=self.cfg.model)
        self.resumed_from = Path(path)
        return run_state
