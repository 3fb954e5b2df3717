"""A full disk, said one way by every writer of a run: its checkpoints
(:mod:`megatron_gspo.train.checkpoint.save`) and its Hugging Face export
(:mod:`megatron_gspo.hf.export`).

The writers fail in their own words on a full disk: ``OSError(ENOSPC)`` from a plain write, torch
``enforce fail at inline_container.cc`` (its zip writer), the safetensors library's
``SafetensorError: Error while serializing: I/O error: No space left on device (os error 28)``
(not an OSError), torch DCP's wrapped per-rank failures. :func:`is_disk_full` recognises each;
:class:`DiskFull` (``errno`` ENOSPC) carries :func:`disk_full_message`: what was being written,
the path, the space it needs, the space free on that filesystem and what to do.
"""

from __future__ import annotations

import errno
from pathlib import Path


class DiskFull(OSError):
    """No space left for what a run writes (errno ENOSPC); the message names the path, the space
    needed and the space free."""

    def __init__(self, message: str, path: str | Path):
        super().__init__(errno.ENOSPC, message, str(path))

    def __reduce__(self):  # pickled as it is built (it crosses ranks: megatron_gspo.collectives)
        return type(self), (self.strerror, self.filename), self.__dict__


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def is_disk_full(err: BaseException) -> bool:
    """ENOSPC / EDQUOT anywhere in ``err``'s chain (torch.distributed.checkpoint wraps the writers'
    errors; torch.save reports a full disk as a failed write of its zip container, safetensors
    as an ``I/O error`` of its own type)."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if ("No space left on device" in text or "Disk quota exceeded" in text
                or "StorageFull" in text or "os error 28" in text):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch DCP's CheckpointException
        if isinstance(failures, dict):
            for value in failures.values():
                todo.append(value if isinstance(value, BaseException)
                            else getattr(value, "exc", None))
    return False


def disk_full_message(kind: str, name: str, where: str | Path, needed: int, free: int,
                      advice: str) -> str:
    """``"<kind> <name>: no space left on device writing <where>: this <kind> needs about N MiB,
    M MiB free on that filesystem; <advice>"``."""
    return (f"{kind} {name}: no space left on device writing {where}: this {kind} needs about "
            f"{mib(needed)}, {mib(free)} free on that filesystem; {advice}")
