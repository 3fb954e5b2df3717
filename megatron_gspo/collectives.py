"""Object collectives, and the one cross-rank outcome protocol: run on rank 0, tell every rank.

:func:`on_rank0` runs a function on rank 0 of a process group and returns its value on every rank
of it, or raises its error on every rank: the same exception object where it pickles and its
class imports on the receiving rank, else a :class:`~megatron_gspo.errors.RemoteError` that keeps
the type's name, the message and whether it was an input error. Rank 0 itself re-raises its
original exception, traceback included. The other ranks meanwhile wait in the broadcast, so a
failure on rank 0 reaches them instead of hanging them in their next collective.

Every function takes the process group explicitly (``group=None`` is the default group) and
works without ``torch.distributed`` initialised: one process, the world of one (a single process
reading a checkpoint). "Rank 0" is rank 0 *of the group*.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from megatron_gspo.errors import RemoteError, is_input_error

__all__ = ["Failure", "Outcome", "all_gather", "broadcast", "initialized", "on_rank0",
           "rank_world"]


def initialized() -> bool:
    """Whether torch.distributed is up (else every collective here is the world of one)."""
    return dist.is_available() and dist.is_initialized()


def rank_world(group=None) -> tuple[int, int]:
    """(this rank in ``group``, the group's size); (0, 1) without torch.distributed."""
    if not initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def broadcast(obj: Any, group) -> Any:
    """Collective over ``group``: the ``obj`` of the group's rank 0, on every rank (pickled)."""
    if not initialized():
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather(obj: Any, group) -> list:
    """Collective over ``group``: every rank's ``obj``, in the group's rank order (pickled)."""
    if not initialized():
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


@dataclass(frozen=True)
class Failure:
    """An exception as it crosses ranks: plain data, and the exception itself pickled when that
    round trip works on the raising rank (``pickled``; None: it does not pickle)."""

    kind: str
    """The exception's class name."""
    message: str
    input_error: bool
    """Whether it is an :class:`~megatron_gspo.errors.InputError`."""
    pickled: Optional[bytes] = None

    @classmethod
    def of(cls, err: BaseException) -> "Failure":
        try:
            pickled = pickle.dumps(err)
            pickle.loads(pickled)  # e.g. an __init__ whose arguments are not its args
        except Exception:  # noqa: BLE001 - any failure: it travels as a RemoteError
            pickled = None
        return cls(type(err).__name__, str(err), is_input_error(err), pickled)

    def error(self) -> BaseException:
        """The exception to raise on this rank: the original's copy, or a RemoteError."""
        if self.pickled is not None:
            try:
                err = pickle.loads(self.pickled)
            except Exception:  # noqa: BLE001 - e.g. its class is not importable on this rank
                err = None
            if isinstance(err, BaseException):
                return err
        return RemoteError.of(self.kind, self.message, self.input_error)


@dataclass
class Outcome:
    """What a call on rank 0 came to: its ``value``, or its ``failure``. ``raised`` (the original
    exception) stays on the rank that raised it: it is not pickled."""

    value: Any = None
    failure: Optional[Failure] = None
    raised: Optional[BaseException] = field(default=None, repr=False)

    @classmethod
    def of(cls, fn: Callable, *args: Any, **kwargs: Any) -> "Outcome":
        """Call ``fn``; its value, or the exception it raised."""
        try:
            return cls(value=fn(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - raised again by result(), on every rank
            return cls(failure=Failure.of(err), raised=err)

    def __getstate__(self) -> dict:
        return {"value": self.value, "failure": self.failure, "raised": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def result(self) -> Any:
        """The value, or the exception raised: the original where it was raised, else
        :meth:`Failure.error`."""
        if self.raised is not None:
            raise self.raised
        if self.failure is not None:
            raise self.failure.error()
        return self.value


def on_rank0(fn: Callable, *args: Any, group, **kwargs: Any) -> Any:
    """Collective over ``group``: ``fn(*args, **kwargs)`` on the group's rank 0 only; its value
    on every rank, or the error it raised, raised on every rank (:class:`Outcome`)."""
    mine = Outcome.of(fn, *args, **kwargs) if rank_world(group)[0] == 0 else None
    shipped = broadcast(mine, group=group)
    return (mine if mine is not None else shipped).result()
