"""The wire formats and channels of the weight sync, shared by the pusher (``pipeline.weights.push``)
and the local rollout server (``pipeline.local``). SGLang 0.5.23's formats unless said otherwise.

* **Flattened buckets** (:func:`flat_layout`, :func:`unflatten`): SGLang's
  ``FlattenedTensorBucket`` (``sglang/srt/weight_sync/tensor_bucket.py``): the tensors' bytes back
  to back, in order, no padding; a tensor whose byte offset is not a multiple of its item size is
  refused (as ``FlattenedTensorBucket.empty`` does).
* **Update groups** (:func:`init_custom_process_group`): the same steps as SGLang's helper of that
  name (``sglang/srt/utils/common.py``, itself from PyTorch / OpenRLHF): ``rendezvous`` on
  ``tcp://address:port`` (rank 0 hosts the TCP store), a ``PrefixStore(group_name)``, then
  ``_new_process_group_helper`` (which prefixes ``group_name/`` and the device again). Both sides
  must run these steps for their store keys to meet: the trainer's side of every group is built
  here, the server's by SGLang itself (or, on the local server without the sglang package, by
  this same function). World size ``1 + sum(tp_size)``, server i's ``rank_offset`` =
  ``1 + sum(tp_size of servers before it)``, the trainer's sending rank is rank 0.
* **Tensor payloads** (:func:`serialize_tensors`): SGLang's ``MultiprocessingSerializer``:
  ``base64(ForkingPickler.dumps(obj))``, one entry per server TP rank. ``ForkingPickler`` turns
  CUDA tensors into CUDA-IPC handles and CPU tensors into shared-memory handles (the
  ``file_system`` strategy, so that an unrelated process - the server - can open them: the
  ``file_descriptor`` strategy needs a multiprocessing authkey the server does not have).
  Deserialising runs pickle, so the local server accepts such payloads only when started with
  ``--allow-pickled-tensors`` on 127.0.0.1, and reads them with a restricted unpickler
  (:func:`deserialize_tensors`: the torch rebuild functions of SGLang's allow-list, nothing else).
  Without that option it accepts its own safe format only, base64 safetensors
  (:func:`encode_named_tensors`).
* **Bucket checksums** (:func:`bucket_checksum`): cheap enough to run after every sync on both
  sides: per tensor, the wrapping int64 sums of its 4 KiB blocks (one vectorised torch reduction,
  ``view(int64).view(-1, 512).sum(1)``), then sha256 over name, dtype, shape and those sums, in
  name order. What it detects: any change confined to one 8-byte word of a block, always (the
  block's sum changes by a nonzero amount below 2**64); random corruption of several words,
  except with probability ~2**-64 per block; a shifted, truncated or transposed tensor larger
  than a block (words move between blocks). What it cannot see: 8-byte words permuted within
  one 4 KiB block, or changes that cancel exactly in a block's sum. Both sides compute it per
  tensor right after writing the tensor (:func:`tensor_sums`: gather, load), so it reads bytes
  still in cache rather than making another pass over memory. A local-server extension: real
  SGLang reports none.
* **bf16 deltas** (:func:`delta_encode`, :func:`delta_apply`): the changed elements of a bf16
  tensor as int32 indices + bf16 values, when that is smaller than the tensor. A local-server
  extension (``"delta": true`` in ``update_weights_from_distributed`` / ``_tensor``).
* **Safetensors shards** (:func:`write_shard`, :func:`read_shard_header`): a flattened bucket IS the data
  section of a safetensors file (same layout), so a shard is a JSON header plus one write.
* :func:`weights_checksum`: the digest ``/weights_checker {"action": "checksum"}`` returns on the
  local server (sha256 over every tensor).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import ipaddress
import json
import os
import pickle
import socket
import struct
import urllib.parse
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
import torch.multiprocessing.reductions  # noqa: F401 - registers torch's reducers (serialize_tensors)
from safetensors.torch import load, save
from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                _world, default_pg_timeout, rendezvous)

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64, "uint8": torch.uint8, "int64": torch.int64,
               "int32": torch.int32, "int16": torch.int16, "float8_e4m3fn": torch.float8_e4m3fn}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling (``str(dtype)`` without ``torch.``), as slime sends it."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r} (expected one of {sorted(DTYPE_NAMES)})")
    return DTYPE_NAMES[name]


# ------------------------------------------------------------------------------------------------
# Flattened buckets (SGLang's FlattenedTensorBucket layout)


def flat_layout(names: Sequence[str], dtypes: Sequence, shapes: Sequence
                ) -> tuple[list[tuple[str, torch.dtype, tuple, int, int]], int]:
    """[(name, dtype, shape, start, end)] byte ranges and the total size, as
    ``FlattenedTensorBucket.empty`` computes them (and refusing what it refuses)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError("names, dtypes and shapes must have the same length")
    if not names:
        raise ValueError("Cannot create empty tensor bucket")
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dtype)
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"Negative dimension in received tensor {name}: {list(shape)}")
        if offset % dtype.itemsize:
            raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append((name, dtype, shape, offset, offset + size))
        offset += size
    return out, offset


def unflatten(flat: torch.Tensor, layout) -> list[tuple[str, torch.Tensor]]:
    """(name, view) of every tensor of a flat uint8 bucket (``reconstruct_tensors``)."""
    return [(name, flat[start:end].view(dtype).reshape(shape))
            for name, dtype, shape, start, end in layout]


# ------------------------------------------------------------------------------------------------
# Checksums


_BLOCK = 512  # int64 words per checksum block (4 KiB)


def _block_sums(data: torch.Tensor) -> bytes:
    """Little-endian int64 sums of the 4 KiB blocks of ``data``'s bytes (the last block zero-padded).

    One streaming pass on the tensor's own device; only the sums (1/512 of the bytes) come to
    the host. Integer sums are exact and independent of the reduction order, so CPU and GPU,
    trainer and server, agree bit for bit.
    """
    raw = data.detach().contiguous().reshape(-1).view(torch.uint8)
    n = raw.numel()
    full = n // (8 * _BLOCK) * (8 * _BLOCK)
    parts = []
    if full:
        body = raw[:full]
        if body.data_ptr() % 8:  # an unaligned view cannot be read as int64 words: copy it
            body = body.clone()
        parts.append(body.view(torch.int64).view(-1, _BLOCK).sum(dim=1))
    if full < n:
        tail = torch.zeros(8 * _BLOCK, dtype=torch.uint8, device=raw.device)
        tail[: n - full] = raw[full:]
        parts.append(tail.view(torch.int64).sum().reshape(1))
    if not parts:
        return b""
    return torch.cat(parts).cpu().numpy().astype("<i8").tobytes()


def tensor_sums(t: torch.Tensor) -> tuple[str, bytes]:
    """One tensor's part of :func:`bucket_checksum`: its ``name``-free header and block sums.
    Called right after a tensor is copied (gather, load), it reads bytes still in cache."""
    return f"{dtype_name(t.dtype)}|{list(t.shape)}|", _block_sums(t)


def checksum_digest(parts: dict[str, tuple[str, bytes]]) -> str:
    """:func:`bucket_checksum` from {name: :func:`tensor_sums`} (any insertion order)."""
    digest = hashlib.sha256()
    for name in sorted(parts):
        head, sums = parts[name]
        digest.update(f"{name}|{head}".encode())
        digest.update(sums)
    return digest.hexdigest()


def bucket_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Digest of a bucket: sha256 over, per tensor in name order (so a receiver need not know the
    sender's order), ``name|dtype|shape|`` and the int64 sums of its 4 KiB blocks
    (:func:`_block_sums`)."""
    return checksum_digest({name: tensor_sums(t) for name, t in named})


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    digest = hashlib.sha256()
    for name, t in sorted(named, key=lambda item: item[0]):
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------
# The local server's safe tensor format (base64 safetensors)


def encode_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """base64(safetensors bytes) of ``named`` (CPU, contiguous copies)."""
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
    return base64.b64encode(save(tensors)).decode("ascii")


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as err:
        raise ValueError(f"serialized_named_tensors: not base64 ({err})") from None
    try:
        return load(raw)
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"serialized_named_tensors: not safetensors bytes ({err}); the local "
                         "server accepts base64 safetensors, and SGLang's pickled tensors only "
                         "when started with --allow-pickled-tensors") from None


# ------------------------------------------------------------------------------------------------
# SGLang's tensor payloads (MultiprocessingSerializer)


def looks_like_pickle(raw: bytes) -> bool:
    """SGLang's ``_looks_like_pickle_payload``: a pickle protocol header."""
    return len(raw) >= 2 and raw[0] == 0x80 and raw[1] <= pickle.HIGHEST_PROTOCOL


def serialize_tensors(obj) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 of ForkingPickler bytes.

    CPU tensors must already live in shared memory of the ``file_system`` strategy
    (:func:`share_cpu_tensor`), or ForkingPickler would move them there on every call.
    """
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def share_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """Move ``t``'s storage into shared memory an unrelated process can open (once; a storage
    already shared this way is left alone)."""
    if t.device.type != "cpu" or t.is_shared():
        return t
    if tmp.get_sharing_strategy() != "file_system":
        # file_descriptor handles are passed through a multiprocessing resource sharer that only
        # processes with this process's authkey (its children) may connect to.
        tmp.set_sharing_strategy("file_system")
    return t.share_memory_()


# The torch globals of SGLang's SafeUnpickler allow-list that tensor payloads need.
_ALLOWED_GLOBALS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"), ("torch", "Tensor"),
    ("torch", "Size"), ("torch", "device"), ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"), ("builtins", "list"), ("builtins", "tuple"),
    ("builtins", "dict"), ("builtins", "slice"),
} | {("torch", name) for name in ("float32", "bfloat16", "float16", "float64", "int64",
                                  "int32", "int16", "uint8", "int8", "bool", "float8_e4m3fn")}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a tensor payload")


def deserialize_tensors(data) -> object:
    """``MultiprocessingSerializer.deserialize`` with an allow-list of torch rebuild functions."""
    raw = base64.b64decode(data, validate=True) if isinstance(data, str) else bytes(data)
    if not looks_like_pickle(raw):
        raise ValueError("not a pickled tensor payload")
    return _RestrictedUnpickler(io.BytesIO(raw)).load()


# ------------------------------------------------------------------------------------------------
# Update groups (SGLang's init_custom_process_group)


def init_custom_process_group(backend=None, init_method=None, timeout=None, world_size=-1,
                              rank=-1, store=None, group_name=None, pg_options=None,
                              device_id=None):
    """A process group outside the default world, made exactly as SGLang makes its side
    (``sglang.srt.utils.common.init_custom_process_group`` in 0.5.23, Apache-2.0, itself copied
    from PyTorch and OpenRLHF): the same rendezvous, prefix stores and helper, so both sides
    write and read the same store keys."""
    assert (store is None) or (init_method is None), "Cannot specify both init_method and store."
    if store is not None:
        assert world_size > 0, "world_size must be positive if using store"
        assert rank >= 0, "rank must be non-negative if using store"
    elif init_method is None:
        init_method = "env://"
    backend = Backend(backend) if backend else Backend("undefined")
    if timeout is None:
        timeout = default_pg_timeout
    if store is None:
        rendezvous_iterator = rendezvous(init_method, rank, world_size, timeout=timeout)
        store, rank, world_size = next(rendezvous_iterator)
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store,
                                      group_name=group_name, backend_options=pg_options,
                                      timeout=timeout, device_id=device_id)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tcp_init_method(address: str, port: int) -> str:
    """``tcp://host:port`` (IPv6 in brackets), as SGLang's ``NetworkAddress.to_tcp``."""
    try:
        wrapped = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        wrapped = address
    return f"tcp://{wrapped}:{int(port)}"


def new_update_group(address: str, port: int, rank: int, world_size: int, *, group_name: str,
                     backend: str = "gloo", timeout_s: float = 300.0):
    """Join (rank 0: host) an update group; blocks until all ``world_size`` ranks joined.

    Rank 0 hosts the group's TCP store on ``address`` only (:func:`bound_store`), not on every
    interface as ``tcp://`` rendezvous does: the servers reach it there, nobody else need."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return init_custom_process_group(
            backend=backend, init_method=tcp_init_method(address, port), timeout=timeout,
            world_size=world_size, rank=rank, group_name=group_name)
    # what tcp:// rendezvous does on rank 0 (a store, its timeout, the group's prefix), bound
    store = bound_store(address, port, world_size, timeout)
    return init_custom_process_group(
        backend=backend, store=PrefixStore(group_name, store), timeout=timeout,
        world_size=world_size, rank=0, group_name=group_name)


def bound_store(address: str, port: int, world_size: int, timeout: datetime.timedelta):
    """A master ``TCPStore`` listening on ``address``:``port`` only: torch's own listens on all
    interfaces whatever host it is given, so the socket is bound here and handed over
    (``master_listen_fd``). Waits, like rendezvous, for the ``world_size - 1`` other ranks."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(max(world_size, 128))
        store = dist.TCPStore(address, port, world_size, True, timeout,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the listening socket now
    store.set_timeout(timeout)
    return store


def destroy_group(group) -> None:
    try:
        dist.destroy_process_group(group)
    except (ValueError, RuntimeError, AssertionError):
        pass  # already gone (the peer died, or the group was never registered)


def routable_address(url: str) -> str:
    """This machine's address on the interface that routes to ``url``'s host: an address that
    host can reach back (no packet is sent; a UDP connect only picks the route)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    info = socket.getaddrinfo(host, 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as sock:
        sock.connect(info[4])
        return sock.getsockname()[0]


def free_port(address: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET,
                       socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def broadcast(group, tensor: torch.Tensor, src: int = 0, *, async_op: bool = False):
    """Broadcast on ``group`` (a group's own rank numbers); returns the work if ``async_op``."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    work = group.broadcast([tensor], opts)
    if async_op:
        return work
    work.wait()
    return None


# ------------------------------------------------------------------------------------------------
# bf16 deltas


DELTA_INDEX, DELTA_VALUE = "::delta_index", "::delta_value"


def delta_encode(name: str, new: torch.Tensor, old: torch.Tensor
                 ) -> Optional[list[tuple[str, torch.Tensor]]]:
    """The changed elements of ``new`` against ``old`` (same shape, 16-bit dtype) as
    ``[(name + DELTA_INDEX, int32 flat indices), (name + DELTA_VALUE, values)]``, or None when
    sending them would not be smaller than ``new`` itself (6 bytes per change vs 2 per element).
    Compared bit for bit (int16 views), so -0.0 vs 0.0 and NaN payloads count as changes."""
    if new.shape != old.shape or new.dtype != old.dtype or new.element_size() != 2:
        raise ValueError(f"{name}: delta needs two 16-bit tensors of one shape")
    if new.numel() >= 2**31:
        return None
    flat_new, flat_old = new.reshape(-1), old.reshape(-1)
    differs = flat_new.view(torch.int16) != flat_old.view(torch.int16)
    if int(differs.sum()) * 6 >= flat_new.numel() * 2:  # counted first: nonzero() is the slow part
        return None
    changed = differs.nonzero().reshape(-1)
    return [(name + DELTA_INDEX, changed.to(torch.int32)), (name + DELTA_VALUE, flat_new[changed])]


def delta_apply(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """target.flat[index] = values (in place)."""
    target.view(-1)[index.to(target.device, torch.long)] = values.to(target.device, target.dtype)


def delta_pairs(named: Iterable[tuple[str, torch.Tensor]]
                ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Split a received bucket into full tensors and {name: (index, values)} deltas."""
    full, idx, val = {}, {}, {}
    for name, t in named:
        if name.endswith(DELTA_INDEX):
            idx[name[: -len(DELTA_INDEX)]] = t
        elif name.endswith(DELTA_VALUE):
            val[name[: -len(DELTA_VALUE)]] = t
        else:
            full[name] = t
    if set(idx) != set(val):
        raise ValueError(f"delta bucket: unpaired entries {sorted(set(idx) ^ set(val))[:5]}")
    return full, {n: (idx[n], val[n]) for n in idx}


# ------------------------------------------------------------------------------------------------
# Safetensors shards


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
              torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
_ST_FROM = {v: k for k, v in _ST_DTYPES.items()}


def write_shard(path: str | Path, layout, flat: torch.Tensor) -> None:
    """A safetensors file from a flattened bucket: the header, then the bucket's bytes as they are
    (safetensors' data section has the same layout). ``flat``: CPU uint8.

    An existing file at ``path`` is overwritten in place (no truncation first, then cut to the
    new size): on tmpfs or a page-cached filesystem its pages are reused instead of allocated
    and zeroed again (``pipeline.weights.disk`` recycles the files of the version it retires)."""
    header = {name: {"dtype": _ST_DTYPES[dtype], "shape": list(shape),
                     "data_offsets": [start, end]} for name, dtype, shape, start, end in layout}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    data = memoryview(flat.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _pwrite_all(fd, head, 0)
        _pwrite_all(fd, data, len(head))
        os.ftruncate(fd, len(head) + len(data))
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def read_shard_header(path: str | Path) -> tuple[list[tuple[str, torch.dtype, tuple, int, int]], int]:
    """(layout in file order, byte offset of the data section) of a safetensors file."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    layout = sorted(((name, _ST_FROM[h["dtype"]], tuple(h["shape"]), *h["data_offsets"])
                     for name, h in header.items()), key=lambda e: e[3])
    return layout, 8 + size
