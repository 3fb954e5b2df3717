"""Reading a torch_dist checkpoint's pickles without running code (issue 22, item 12).

A Megatron ``torch_dist`` checkpoint (``model_optim/`` of a training checkpoint, or a converted
one) holds three kinds of pickles, all read by torch / Megatron with a plain unpickler or
``torch.load`` with ``weights_only`` off, i.e. able to run any code a tampered file asks for:

* ``.metadata``: torch.distributed.checkpoint's ``Metadata``, ``pickle.load``-ed by
  ``FileSystemReader.read_metadata`` (torch/distributed/checkpoint/filesystem.py);
* the byte items of the ``.distcp`` files (Megatron's ``ShardedObject`` s, e.g. every layer's
  ``_extra_state``): ``torch.load`` with ``weights_only`` off in
  ``DefaultLoadPlanner.load_bytes`` (default_planner.py);
* ``common.pt``: ``torch.load`` with torch's default (``weights_only=True`` since torch 2.6,
  unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set).

:func:`read_metadata` unpickles ``.metadata`` with :class:`MetadataUnpickler`, which resolves only
the classes torch's checkpoint metadata is made of (:data:`ALLOWED`: ``metadata.py``'s dataclasses,
``filesystem._StorageInfo``, the save plans ``planner.py`` records in ``all_local_plans``,
``torch.Size``, the torch dtypes, ``torch.serialization._get_layout``, and ``pathlib`` paths for
``StorageMeta.checkpoint_id``); any other global is a
:class:`UnsafeCheckpointError` naming the file and the global, raised before anything is
called. :func:`check_torch_dist` vets a whole directory before Megatron reads it: ``.metadata``
that way, then every byte item and ``common.pt`` with torch's ``weights_only`` unpickler, so the
later unrestricted reads only ever see pickles that had been shown to be plain data.
:class:`SafeFileSystemReader` is torch's ``FileSystemReader`` with the allow-listed
``read_metadata`` (used where this project opens a checkpoint itself,
``megatron_gspo.hf.mcore_checkpoint``).

What this does not do: it does not authenticate the checkpoint. The manifest
(``megatron_gspo.train.checkpoint``) catches damage, not an attacker who rewrites a file and its
manifest entry; such a checkpoint is refused here only when it tries to run code, while altered
weights or run state load as any other. The check and Megatron's own read are two reads of the
same file (someone able to write it in between could equally replace the code).
"""

from __future__ import annotations

import functools
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
        "TensorWriteData", "BytesIOWriteData"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "collections": frozenset({"OrderedDict"}),
    # StorageMeta.checkpoint_id is the path the writer was given (a Path when it was one);
    # building a path object touches no file
    "pathlib": frozenset({"Path", "PosixPath", "PurePath", "PurePosixPath", "WindowsPath",
                          "PureWindowsPath"}),
}
"""(module, name) pairs ``.metadata`` may name; in ``torch`` also every ``torch.dtype``."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint pickle that names a global outside the allow-list (it could run code), or one
    that cannot be vetted; the message names the file."""


class MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` resolving only :data:`ALLOWED` (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not one of the classes torch's checkpoint metadata "
            "is made of")


def read_metadata(path: str | Path):
    """The ``Metadata`` of ``path`` (a ``.metadata`` file), unpickled with the allow-list;
    :class:`UnsafeCheckpointError` naming the file if it names anything else or is not a
    ``Metadata``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except UnsafeCheckpointError:
        raise
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"{path}: refused: {err}; the file was not loaded (a "
                                    "tampered checkpoint?)") from None
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged pickle raises anything
        raise UnsafeCheckpointError(f"{path}: unreadable checkpoint metadata "
                                    f"({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not torch's "
                                    "checkpoint Metadata")
    return metadata


def _weights_only(raw: bytes, where: str) -> None:
    try:
        torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - every refusal is the same answer
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UnsafeCheckpointError(f"{where}: refused: not plain data for torch's weights_only "
                                    f"loader ({first[:300]}); the checkpoint was not loaded (a "
                                    "tampered checkpoint?)") from None


def check_torch_dist(directory: str | Path):
    """Vet every pickle of the torch_dist ``directory`` that torch / Megatron would unpickle
    without restriction (see the module docstring); returns its ``Metadata``. Raises
    :class:`UnsafeCheckpointError` naming the file (and the item) that is refused."""
    directory = Path(directory)
    metadata = read_metadata(directory / ".metadata")
    byte_keys = {k for k, md in (metadata.state_dict_metadata or {}).items()
                 if isinstance(md, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if getattr(index, "fqn", None) not in byte_keys:
            continue
        name = Path(str(info.relative_path))
        if name.is_absolute() or ".." in name.parts:
            raise UnsafeCheckpointError(f"{directory / '.metadata'}: item {index.fqn!r} is "
                                        f"stored at {str(name)!r}, outside the checkpoint")
        where = f"{directory / name} (item {index.fqn!r})"
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(f"{where}: stored with transforms "
                                        f"{list(info.transform_descriptors)}, which this check "
                                        "cannot read; refused")
        with open(directory / name, "rb") as f:
            f.seek(int(info.offset))
            raw = f.read(int(info.length))
        _weights_only(raw, where)
    common = directory / "common.pt"
    if common.is_file():
        _weights_only(common.read_bytes(), str(common))
    return metadata


@functools.cache
def _safe_reader_class():
    class SafeFileSystemReader(FileSystemReader):
        """torch's ``FileSystemReader`` whose ``read_metadata`` uses the allow-list."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader


def SafeFileSystemReader(path: str | Path):  # noqa: N802 - a class, built on first use
    return _safe_reader_class()(path)
