"""Streaming safetensors: read a Hugging Face checkpoint lazily, write shards tensor by tensor.

Hugging Face checkpoints are safetensors files (``model.safetensors``, or shards listed in
``model.safetensors.index.json``). The format is simple::

    [8 bytes: little-endian u64 N][N bytes: JSON header][data]
    header = {name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin, end]}, ...,
              "__metadata__": {...}}       offsets are relative to the start of [data]

Reading here uses plain positioned reads (``readinto`` into the destination tensor), never a
memory map: mapped file pages count in a process's resident set, so reading a 60 GB checkpoint
through ``mmap`` shows a 60 GB RSS even though the pages are reclaimable. With positioned reads the
process holds only the tensors it asked for, and a row range of a tensor costs one read of just
those bytes. Every header is validated when the checkpoint is opened, so a missing shard, a
truncated file or an index that names a tensor its shard lacks fail at once, naming the file.

Writing is the mirror image: :class:`ShardWriter` writes the header for a known list of tensors
first, then accepts the tensors (or consecutive row blocks of one tensor) in that order, so a
shard of any size is written with the memory of one block. ``tests/unit/test_convert_io.py``
checks both directions against the ``safetensors`` library itself.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from megatron_gspo.errors import InputError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class CheckpointError(ValueError, InputError):
    """A checkpoint on disk is missing, damaged or inconsistent; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte offset of its data."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute, in the file
    nbytes: int


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one safetensors file's header; returns (tensors, __metadata__)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file (header claims {header_len} bytes, "
                f"file has {size})")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {err})")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + header_len
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: tensor {name}: malformed header entry {entry!r} ({err})")
        nbytes = math.prod(shape) * _element_size(dtype)
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name}: data_offsets {begin}..{end} do not hold "
                f"{entry['dtype']} {list(shape)} ({nbytes} bytes)")
        tensors[name] = TensorInfo(path, dtype, shape, data_start + begin, nbytes)
        data_end = max(data_end, end)
    if data_start + data_end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: the header needs {data_start + data_end} bytes, "
            f"the file has {size}")
    return tensors, metadata


def read_into(info: TensorInfo, out: torch.Tensor, rows: Optional[slice] = None, *,
              handle=None) -> torch.Tensor:
    """Read ``info``'s tensor (or rows ``rows`` of its first dim) into the contiguous ``out``."""
    start, stop = (0, info.shape[0] if info.shape else 1) if rows is None else (rows.start, rows.stop)
    row_bytes = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
    want = (stop - start) * row_bytes
    if not out.is_contiguous() or out.dtype != info.dtype or out.numel() * out.element_size() != want:
        raise ValueError(f"read_into {info.path}: destination {tuple(out.shape)} {out.dtype} does not "
                         f"fit {want} bytes of {info.dtype}")
    if want == 0:
        return out
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    close = handle is None
    f = open(info.path, "rb", buffering=0) if handle is None else handle
    try:
        # positioned reads (no shared file position): safe from several writer threads at once
        position, done = info.offset + start * row_bytes, 0
        while done < want:
            n = os.preadv(f.fileno(), [view[done:]], position + done)
            if not n:
                raise CheckpointError(f"{info.path}: truncated safetensors file (short read)")
            done += n
    finally:
        if close:
            f.close()
    return out


class HFCheckpoint:
    """A Hugging Face safetensors checkpoint directory, opened lazily (headers only).

    ``reader.read(name, rows=slice(a, b))`` returns the tensor (or rows a..b of it) as a new
    tensor; ``reader.read_into(name, out, rows)`` fills an existing contiguous tensor.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        index_path = self.directory / INDEX_FILE
        self.tensors: dict[str, TensorInfo] = {}
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index_path}: not a valid safetensors index ({err})")
            files = sorted(set(weight_map.values()))
            missing = [f for f in files if not (self.directory / f).is_file()]
            if missing:
                raise CheckpointError(
                    f"{index_path}: {len(missing)} shard(s) listed in the index are missing from "
                    f"{self.directory}: {', '.join(missing)}")
            per_file = {f: read_header(self.directory / f)[0] for f in files}
            absent = [f"{name} (in {file})" for name, file in weight_map.items()
                      if name not in per_file[file]]
            if absent:
                raise CheckpointError(
                    f"{index_path}: {len(absent)} tensor(s) are not in the shard the index names: "
                    f"{', '.join(absent[:10])}{' ...' if len(absent) > 10 else ''}")
            self.tensors = {name: per_file[file][name] for name, file in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            self.tensors = read_header(self.directory / SINGLE_FILE)[0]
        else:
            raise CheckpointError(
                f"{self.directory}: no {SINGLE_FILE} and no {INDEX_FILE} (is this a Hugging Face "
                "safetensors checkpoint?)")
        self._handles: dict[Path, object] = {}
        self._lock = threading.Lock()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self.tensors.items()}

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} is not in the checkpoint") from None

    def _handle(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            with self._lock:  # writer threads may ask for the same file at once
                handle = self._handles.get(path)
                if handle is None:
                    handle = self._handles[path] = open(path, "rb", buffering=0)
        return handle

    def read_into(self, name: str, out: torch.Tensor, rows: Optional[slice] = None) -> torch.Tensor:
        info = self.info(name)
        return read_into(info, out, rows, handle=self._handle(info.path))

    def map_rows(self, name: str, rows: slice) -> torch.Tensor:
        """Rows ``rows`` of a tensor as a read-only view of a memory map of just those bytes (no
        copy). The mapping lives as long as the tensor; its pages are the page cache's, so keep
        such tensors short-lived (they count in RSS while mapped). Do not write to it."""
        info = self.info(name)
        row_bytes = info.nbytes // max(1, info.shape[0])
        start = info.offset + rows.start * row_bytes
        length = (rows.stop - rows.start) * row_bytes
        shape = (rows.stop - rows.start, *info.shape[1:])
        if length == 0:
            return torch.empty(shape, dtype=info.dtype)
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._handle(info.path).fileno(), length + start - aligned,
                            flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            prot=mmap.PROT_READ, offset=aligned)
        with warnings.catch_warnings():  # "The given buffer is not writable": read-only by design
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mapping, dtype=info.dtype, count=length // info.dtype.itemsize,
                                    offset=start - aligned)
        return flat.view(shape)

    def read(self, name: str, rows: Optional[slice] = None) -> torch.Tensor:
        info = self.info(name)
        shape = info.shape if rows is None else (rows.stop - rows.start, *info.shape[1:])
        return self.read_into(name, torch.empty(shape, dtype=info.dtype), rows)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardWriter:
    """Write one safetensors file whose tensors (names, shapes, dtypes, order) are known up front.

    ``write(name, tensor)`` appends the next bytes: a whole tensor, or consecutive row blocks of
    it (first dim) in several calls. Names must come in the declared order; ``close`` checks that
    every declared byte was written.
    """

    def __init__(self, path: str | os.PathLike, entries: Iterable[tuple[str, tuple, torch.dtype]],
                 metadata: Optional[dict[str, str]] = None):
        self.path = Path(path)
        self.entries = [(name, tuple(shape), dtype) for name, shape, dtype in entries]
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        offset = 0
        self._sizes = []
        for name, shape, dtype in self.entries:
            nbytes = math.prod(shape) * _element_size(dtype)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            self._sizes.append(nbytes)
            offset += nbytes
        self.data_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as in safetensors
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._index = 0
        self._written = 0  # bytes of the current entry

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._index >= len(self.entries):
            raise ValueError(f"{self.path}: {name}: every declared tensor is already written")
        expect_name, shape, dtype = self.entries[self._index]
        if name != expect_name or tensor.dtype != dtype or tuple(tensor.shape[1:]) != shape[1:]:
            raise ValueError(f"{self.path}: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected "
                             f"{expect_name} {shape} {dtype} next")
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._written + data.nbytes > self._sizes[self._index]:
            raise ValueError(f"{self.path}: {name}: more rows than its declared shape {shape}")
        self._file.write(memoryview(data))
        self._written += data.nbytes
        if self._written == self._sizes[self._index]:
            self._index += 1
            self._written = 0

    @property
    def complete(self) -> bool:
        """Every declared tensor has been written."""
        return self._index == len(self.entries)

    def close(self, *, fsync: bool = True) -> None:
        if self._index != len(self.entries) and self.entries:
            name = self.entries[self._index][0]
            self._file.close()
            raise ValueError(f"{self.path}: closed before {name} (and {len(self.entries) - self._index - 1} "
                             "more) were written")
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()


def plan_shards(entries: list[tuple[str, tuple, torch.dtype]], max_shard_bytes: int
                ) -> list[list[tuple[str, tuple, torch.dtype]]]:
    """Split ordered entries into consecutive shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * _element_size(entry[2])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """Hugging Face's shard naming: model-00001-of-00003.safetensors."""
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (Path(directory) / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def parse_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '512MiB' -> 512 * 2**20, '1000' -> 1000."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise ValueError(f"size {text!r}: expected a number with an optional unit (e.g. 5GB)")
    unit = match.group(2).upper()
    if unit not in units:
        raise ValueError(f"size {text!r}: unknown unit {match.group(2)!r} (use B, KB, MB, GB, KiB, "
                         "MiB, GiB)")
    return int(float(match.group(1)) * units[unit])
