"""The transport interface of the weight sync, and the cross-rank pieces every transport shares.

:class:`~pipeline.weights.push.WeightPusher` does what every push does, whatever carries the
bytes: pause, negotiation, the bucket order, the checks, the versions, the recovery. A
:class:`Transport` does the rest, one module each: :mod:`pipeline.weights.disk` (safetensors
shards on a shared filesystem, ``update_weights_from_disk``), :mod:`pipeline.weights.tensor`
(``update_weights_from_tensor``) and :mod:`pipeline.weights.distributed` (a broadcast group per
source rank, ``update_weights_from_distributed``). The pusher chooses one in its constructor and
calls it at the same points of every push (module docstring of :mod:`pipeline.weights.push`):

* rank 0, step 1: :meth:`Transport.check_server` per server, then :meth:`Transport.begin`;
* every rank, step 2: :meth:`Transport.connect` (collective);
* per bucket, on its source rank, step 3: :meth:`Transport.send`;
* rank 0, step 4: :meth:`Transport.end`, or :meth:`Transport.recover` after a failure.

A transport sees its pusher only through :class:`Pusher` (no import of the pusher's module).

A step's outcome crosses ranks as the library's one cross-rank outcome protocol
(:mod:`megatron_gspo.collectives`): an :class:`~megatron_gspo.collectives.Outcome`, or a
:class:`~megatron_gspo.collectives.Failure` where only the error matters, broadcast or
all-gathered, the error raised again at the end as its own type (:func:`failure_at`,
:func:`first_failure`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, ClassVar, Optional, Protocol

import torch

from megatron_gspo.collectives import Failure, all_gather
from megatron_gspo.errors import RemoteError
from pipeline.generation import client as rollout
from pipeline.weights.stats import SyncStats


# ---------------------------------------------------------------------------------- cross-rank
def failure_at(err: BaseException, where: str) -> Failure:
    """``err`` as it crosses ranks, ``where`` (e.g. ``rank 1, bucket 3``) added as its note, so
    that :func:`megatron_gspo.errors.one_line` of it reads ``rank 1, bucket 3: Type: message``
    on every rank. An error that does not survive pickling crosses as a
    :class:`~megatron_gspo.errors.RemoteError` that keeps the note too."""
    err.add_note(where)
    failure = Failure.of(err)
    if failure.pickled is None:
        remote = RemoteError.of(failure.kind, failure.message, failure.input_error)
        remote.add_note(where)
        failure = Failure.of(remote)
    return failure


def first_failure(failure: Optional[Failure], group) -> Optional[Failure]:
    """Collective over ``group``: the failure of the first rank (in rank order) that has one,
    the same on every rank (None: no rank failed)."""
    return next((f for f in all_gather(failure, group) if f is not None), None)


class Pusher(Protocol):
    """What a transport uses of the pusher that owns it (``WeightPusher``)."""

    server_urls: list[str]
    transport: str
    """The transport's name (``rollout.weight_sync.transport``), for messages."""
    timeout_s: float
    """The bound of every HTTP call of a push."""
    pool: Executor
    """The pusher's thread pool (answers are collected bucket by bucket)."""
    tp: Optional[list[int]]
    """Per server, its TP size (``/server_info``, read at each push's start)."""
    verify_now: bool
    """This push verifies checksums (negotiated)."""
    group: Any
    """The process group of the push's control messages (None: the default group)."""

    def each_server(self, fn: Callable[[str], Any]) -> list:
        """``fn(url)`` for every server, concurrently; the results in server order."""

    def headers(self, server_index: int) -> Optional[dict]:
        """The negotiation header of a request to server ``server_index`` (None: plain SGLang)."""

    def check(self, url: str, what: str, answer, expected: str) -> None:
        """Raise unless every TP rank's checksum of ``what`` in ``answer`` is ``expected``."""


# ---------------------------------------------------------------------------------- interface
class Transport:
    """How the buckets reach the servers. ``pusher``: the pusher that owns it (its servers, their
    TP sizes, the negotiated extensions, the thread pool, the HTTP bound: :class:`Pusher`)."""

    takes_turns: ClassVar[bool] = False
    """The sources pass a turn token bucket by bucket (``WeightPusher._send_all``): needed where
    two sources' sends could otherwise be pending at once (broadcast groups)."""
    supports_delta: ClassVar[bool] = True
    """Whether the bf16 delta pushes (``delta``) can go over it."""

    def __init__(self, pusher: Pusher):
        self.pusher = pusher

    def check_server(self, url: str, info: dict) -> None:
        """Rank 0, step 1: refuse a server (its ``/server_info``) this transport cannot update."""

    def begin(self, version: str) -> None:
        """Rank 0, step 1, after the pause and the negotiation: prepare the push."""

    def connect(self, sources: list[int], stats: SyncStats) -> Optional[Failure]:
        """Every rank, step 2 (collective): whatever must exist before the first bucket; the
        first failing rank's failure, the same on every rank (None: ready)."""
        return None

    def send(self, bucket, version: str, wire: list[tuple[str, torch.Tensor]],
             wire_flat: torch.Tensor, extra: dict, entry: dict) -> Optional[list]:
        """Step 3, on the bucket's source rank: send ``wire`` (the bucket, or its delta entries;
        ``wire_flat`` their bytes back to back; ``extra`` the request's extra fields). Returns
        the servers' answers (values or futures), or None where the servers answer only at
        :meth:`end`; ``entry`` is the bucket's record (``WeightPusher._send_bucket``). Nothing
        reads the bucket's buffer once the answers are in."""
        raise NotImplementedError

    def end(self, version: str, buckets: dict, stats: SyncStats, stream) -> None:
        """Rank 0, step 4, every bucket sent: make the servers load (or finish) the update."""
        raise NotImplementedError

    def recover(self, notes: list[str]) -> None:
        """Rank 0, after a failed step: undo what :meth:`begin` opened (what could not be undone
        goes to ``notes``)."""

    def reset(self) -> None:
        """The servers changed (``WeightPusher.set_servers``): drop what was made for the old
        ones."""

    def close(self) -> None:
        """The pusher closes: release what the transport holds."""


class SessionTransport(Transport):
    """A transport whose updates SGLang 0.5.23 accepts only inside a weight-update session
    (``/begin_weight_update`` ... ``/end_weight_update``): ``tensor`` and ``distributed``."""

    def __init__(self, pusher: Pusher):
        super().__init__(pusher)
        self.session_open = False  # rank 0: a weight-update session is open on the servers

    def check_server(self, url: str, info: dict) -> None:
        if int(info.get("dp_size") or 1) != 1:
            raise ValueError(
                f"{url}: rollout.weight_sync.transport {self.pusher.transport}: the server runs "
                f"{info.get('dp_size')} data-parallel replicas (dp_size), and SGLang updates "
                "weights from a group or from tensors only with dp_size 1; use "
                "rollout.weight_sync.transport: disk, or data-parallel attention (attn_dp_size)")

    def begin(self, version: str) -> None:
        self.session_open = True
        self.pusher.each_server(lambda u: rollout.control(u, "/begin_weight_update",
                                                          {"selector": "all"},
                                                          timeout_s=self.pusher.timeout_s))

    def end(self, version: str, buckets: dict, stats: SyncStats, stream) -> None:
        self.pusher.each_server(lambda u: rollout.control(u, "/end_weight_update", {},
                                                          timeout_s=self.pusher.timeout_s))
        self.session_open = False

    def recover(self, notes: list[str]) -> None:
        if not self.session_open:
            return
        self.session_open = False
        for url in self.pusher.server_urls:
            try:
                rollout.control(url, "/end_weight_update", {},
                                timeout_s=min(self.pusher.timeout_s, 60))
            except rollout.RolloutError as err:
                if "no weight-update session is open" not in str(err):
                    notes.append(f"closing the session failed: {err}")

