"""Weight payloads shared by the trainer (megatron_gspo.hf.weight_sync) and the local rollout server.

* ``update_weights_from_tensor`` body: SGLang's request shape
  ``{"serialized_named_tensors": [<base64 str per TP rank>], "load_format": ...}``, but each
  entry is **base64 of safetensors bytes** (:func:`encode_named_tensors`), never a pickle.
  *Deviation from SGLang*, whose entries are ``base64(ForkingPickler.dumps(list[(name, tensor)]))``
  carrying CUDA-IPC handles: unpickling runs arbitrary code and IPC handles need a shared GPU.
  A real SGLang server therefore cannot read these payloads; against real SGLang use the disk or
  distributed transport (or a server-side custom ``load_format`` loader).
* ``update_weights_from_distributed``: a process group of its own between trainer rank 0 (rank 0)
  and each server (``rank_offset + tp_rank``), created by :func:`new_update_group` from a TCP
  store, so it never touches a process's default ``torch.distributed`` group. NCCL on GPUs (what
  SGLang uses), gloo on CPUs (what the local server implements).
* :func:`weights_checksum`: the digest ``/weights_checker {"action": "checksum"}`` returns on the
  local server, so a test or a run can check server-side weights bit for bit.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import socket
from typing import Iterable

import torch

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64, "uint8": torch.uint8, "int64": torch.int64,
               "int32": torch.int32}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling (``str(dtype)`` without ``torch.``), as slime sends it."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str) -> torch.dtype:
    if name.startswith("torch."):
        name = name[len("torch."):]
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {name!r} (expected one of {sorted(DTYPE_NAMES)})")
    return DTYPE_NAMES[name]


def encode_named_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """base64(safetensors bytes) of ``named`` (CPU, contiguous copies)."""
    from safetensors.torch import save

    tensors = {name: t.detach().to("cpu").contiguous() for name, t in named}
    return base64.b64encode(save(tensors)).decode("ascii")


def decode_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        raw = base64.b64decode(payload, validate=True)
    except (ValueError, TypeError) as err:
        raise ValueError(f"serialized_named_tensors: not base64 ({err})") from None
    try:
        return load(raw)
    except Exception as err:  # safetensors raises its own error types
        raise ValueError(f"serialized_named_tensors: not safetensors bytes ({err}); the local "
                         "server accepts base64 safetensors, never pickles") from None


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    digest = hashlib.sha256()
    for name, t in sorted(named, key=lambda item: item[0]):
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{name}|{dtype_name(t.dtype)}|{list(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def new_update_group(master_address: str, master_port: int, rank: int, world_size: int, *,
                     group_name: str = "weight_update_group", backend: str = "gloo",
                     timeout_s: float = 300.0):
    """A process group of its own (not the default group): rank 0 hosts the TCP store.

    Blocks until all ``world_size`` ranks have joined (or ``timeout_s``). Returns ``(group, store)``;
    keep both alive while the group is used.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                          timeout=timeout)
    prefixed = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        if _is_loopback(master_address):
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"backend {backend!r}: expected 'gloo' or 'nccl'")
    return group, store


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()
