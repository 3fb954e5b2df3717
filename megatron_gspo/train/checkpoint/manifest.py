"""A checkpoint's manifest and its verification: ``manifest.json`` holds the size and sha256 of
every other file of the checkpoint, and what wrote it (the stack, the layout, the model:
``megatron_gspo.train.checkpoint.save``). :func:`verify_checkpoint` checks the files against it
(each rank hashes a share: :func:`_my_share`); :func:`latest_checkpoint` picks the newest intact
checkpoint of a run.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megatron_gspo.collectives import all_gather, rank_world
from megatron_gspo.errors import InputError

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError, InputError):
    """A checkpoint that cannot be resumed from: damaged, partial, or missing a file this run
    needs. The message names the checkpoint and the file."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def list_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` except the manifest, as sorted relative paths."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.is_file() and p.relative_to(directory) != Path(MANIFEST))


_WRITTEN_BY = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank_(\d+)\.pt)$")
"""The files one rank writes: torch DCP's ``__<rank>_<n>.distcp`` data files (the bulk of a
checkpoint: every rank's shards of the model and the optimizer) and the RNG files."""

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
    rank, world = rank_world(group)
    return [n for n in names if (writer_rank(n) or 0) % world == rank]


def describe_files(directory: Path, names: Sequence[str], group=None) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of ``names`` under ``directory``; collective (each rank hashes
    its share, :data:`HASH_THREADS` files at a time)."""
    share = _my_share(names, group)
    digests = _threaded(lambda n: _sha256(directory / n), share)
    mine = {n: {"size": (directory / n).stat().st_size, "sha256": d}
            for n, d in zip(share, digests)}
    out: dict[str, dict] = {}
    for part in all_gather(mine, group):
        out.update(part)
    return out


def read_manifest(path: Path) -> dict:
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


def verified(path: Path) -> bool:
    """Whether this process found the checkpoint ``path`` intact (as its manifest is now)."""
    key = _verified_key(path)
    return key is not None and key in _verified


def verify_checkpoint(path: str | Path, *, group=None) -> list[str]:
    """What is wrong with the checkpoint ``path`` (empty: intact): a missing or damaged manifest,
    and every file whose size or sha256 differs from it, by name. Collective when
    torch.distributed is initialised (each rank checks a share of the files), local otherwise."""
    path = Path(path)
    try:
        files = read_manifest(path)["files"]
    except CheckpointError as err:
        problems = [str(err)]
    else:
        problems = _problems(path, files, _my_share(sorted(files), group))
    merged: list[str] = []
    for part in all_gather(problems, group):
        merged += [p for p in part if p not in merged]
    key = _verified_key(path)
    if not merged and key is not None:
        _verified.add(key)
    return merged


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories under ``root``, newest step first (``.tmp`` ones excluded)."""
    found = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found, reverse=True)]


def say(message: str) -> None:
    """Rank 0 (or the one process): ``message`` on stderr."""
    if rank_world()[0] == 0:
        print(message, file=sys.stderr, flush=True)


def latest_checkpoint(run_dir: str | Path, *, group=None) -> Optional[Path]:
    """The newest intact checkpoint of a run, or None when the run has none.

    Checkpoints are tried newest first; one that fails :func:`verify_checkpoint` is reported (on
    stderr, naming the damaged file) and the next older one is tried. Raises
    :class:`CheckpointError` when there are checkpoints but none is intact. Collective when
    torch.distributed is initialised (every rank calls it)."""
    root = checkpoint_root(run_dir)
    candidates = step_dirs(root)
    if not candidates:
        return None
    marker = root / "latest"
    named = marker.read_text().strip() if marker.is_file() else None
    damaged: list[str] = []
    for path in candidates:
        problems = verify_checkpoint(path, group=group)
        if not problems:
            if damaged:
                say("resume: " + "; ".join(damaged) + f"; resuming from {path} instead "
                     "(the newest intact checkpoint)")
            elif named is not None and named != path.name:
                say(f"resume: {marker} names {named}, but {path.name} is newer and intact "
                     f"(a save ended before updating the marker); resuming from {path}")
            return path
        damaged.append(f"checkpoint {path} is damaged ({'; '.join(problems[:5])}"
                       + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "") + ")")
    raise CheckpointError("no intact checkpoint to resume from: " + "; ".join(damaged)
                          + f". Remove the damaged directories from {root} to start over")
