"""The ``distributed`` transport: a broadcast group per source rank with every GPU of every server.

First push (and after the servers change): each source rank builds its own update group with
every GPU of every server, one source after the other (a server joins one group at a time):
world ``1 + sum(tp_size)``, server i at ``rank_offset`` 1 + the TP sizes before it, the source
rank is rank 0, its address routable from the servers (``transport.init_custom_process_group``).
Per bucket: ``/update_weights_from_distributed`` (``load_format: flattened_bucket``) to every
server, then one broadcast of the flat bucket (NCCL on GPUs, gloo on CPU). The sources take
turns bucket by bucket (``takes_turns``): no two sources' broadcasts are ever pending at once.
Inside a weight-update session (:class:`SessionTransport`).
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_gspo.collectives import Failure, Outcome
from pipeline.generation import client as rollout
from pipeline.weights import transport as wt
from pipeline.weights.interface import Pusher, SessionTransport, first_failure
from pipeline.weights.stats import SyncStats


_POLL_S = 0.005
"""How often a pending broadcast is checked against the servers' answers."""
_ABANDON_WAIT_S = 10.0
"""How long an abandoned broadcast may take to end once its groups are closed."""


class DistributedTransport(SessionTransport):
    """``master_address``: the address the servers reach a source rank's update group at; None:
    the address of the source's own interface that routes to the first server.
    ``group_name``: the groups' name prefix (``{group_name}_r{rank}``). ``backend``: the
    groups' backend (None: nccl with CUDA, gloo without)."""

    takes_turns = True

    def __init__(self, pusher: Pusher, *, master_address: Optional[str], group_name: str,
                 backend: Optional[str]):
        super().__init__(pusher)
        self.master_address = master_address
        self.group_name = group_name
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._update_group = None  # this rank's (a source's) update group
        self._group_made = False

    def my_group_name(self) -> str:
        return f"{self.group_name}_r{dist.get_rank()}"

    def check_server(self, url: str, info: dict) -> None:
        super().check_server(url, info)
        if int(info.get("pp_size") or 1) != 1:
            raise ValueError(f"{url}: rollout.weight_sync.transport distributed: servers with "
                             f"pp_size {info.get('pp_size')} > 1 are not supported (their "
                             "update-group ranks are not tp_rank + rank_offset); use disk")

    def connect(self, sources: list[int], stats: SyncStats) -> Optional[Failure]:
        """The update groups, on the first push (and after :meth:`reset`)."""
        if self._group_made:
            return None
        t0 = time.perf_counter()
        failure = self._make_groups(sources)
        stats.phases["init_groups_s"] = time.perf_counter() - t0
        return failure

    def _make_groups(self, sources: list[int]) -> Optional[Failure]:
        """One update group per source rank, made one after the other (collective); the first
        failing source's failure, on every rank."""
        rank = dist.get_rank()
        tp = self.pusher.tp
        world = 1 + sum(tp)
        offsets = [1 + sum(tp[:i]) for i in range(len(tp))]
        for src in sources:
            mine = Outcome.of(self._make_group, world, offsets).failure if rank == src else None
            failure = first_failure(mine, self.pusher.group)
            if failure is not None:
                return failure
        self._group_made = True
        return None

    def _make_group(self, world: int, offsets: list[int]) -> None:
        p = self.pusher
        address = self.master_address or wt.routable_address(p.server_urls[0])
        port = wt.free_port(address)
        name = self.my_group_name()
        # Each server's call blocks until the whole group has joined: issue them concurrently.
        futures = [p.pool.submit(self._join_server, u, address=address, port=port,
                                 rank_offset=offsets[i], world=world, name=name)
                   for i, u in enumerate(p.server_urls)]
        try:
            self._update_group = wt.new_update_group(address, port, 0, world, group_name=name,
                                                     backend=self.backend, timeout_s=p.timeout_s)
        finally:
            for f in futures:
                f.result()

    def _join_server(self, url: str, *, address: str, port: int, rank_offset: int, world: int,
                     name: str):
        """One server's side of joining the update group (SGLang's
        ``/init_weights_update_group``); blocks until the whole group has joined."""
        return rollout.control(url, "/init_weights_update_group",
                               {"master_address": address, "master_port": port,
                                "rank_offset": rank_offset, "world_size": world,
                                "group_name": name, "backend": self.backend},
                               timeout_s=self.pusher.timeout_s)

    def send(self, bucket, version: str, wire, wire_flat: torch.Tensor, extra: dict,
             entry: dict) -> list:
        p = self.pusher
        body = {"names": [n for n, _ in wire], "dtypes": [wt.dtype_name(t.dtype) for _, t in wire],
                "shapes": [list(t.shape) for _, t in wire], "group_name": self.my_group_name(),
                "flush_cache": False, "abort_all_requests": False,
                "load_format": "flattened_bucket", **extra}
        answers = [p.pool.submit(rollout.control, u, "/update_weights_from_distributed", body,
                                 timeout_s=p.timeout_s, headers=p.headers(i))
                   for i, u in enumerate(p.server_urls)]
        device = "cuda" if self.backend == "nccl" else "cpu"
        tensor = wire_flat.to(device)
        work = wt.broadcast(self._update_group, tensor, 0, async_op=True)
        self._await_broadcast(work, answers)
        return answers

    def _await_broadcast(self, work, answers: list) -> None:
        """Wait for the bucket's broadcast. A server that answered with an error before the
        broadcast completed refused the bucket without joining it (an unknown dtype or group, no
        session): the broadcast would wait for the group's timeout. Instead the groups are closed
        at once (:meth:`_abandon`) and that server's error is raised."""
        while not work.is_completed():
            refused = next((a for a in answers if a.done() and a.exception() is not None), None)
            if refused is not None:
                self._abandon(work)
                raise refused.exception()
            time.sleep(_POLL_S)
        work.wait()  # the broadcast's own error, if it failed

    def _abandon(self, work) -> None:
        """Close the update groups around a broadcast that a server will never join: the
        servers' side first (a member that leaves ends the pending send with an error; gloo's
        ``abort`` does not), then this rank's (NCCL: ``abort`` ends the pending kernel), waiting
        a bounded time for the pending work to end. The next push makes the groups again."""
        self._destroy_server_groups()
        try:
            self._update_group.abort()
        except (RuntimeError, AttributeError):
            pass  # gone already, or a backend without abort
        deadline = time.monotonic() + _ABANDON_WAIT_S
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        wt.destroy_group(self._update_group)
        self._update_group, self._group_made = None, False

    def reset(self) -> None:
        """Tear down the update groups on the servers (a dead one does not answer: nothing to
        undo there) and on this rank; the next push makes them again."""
        if self._update_group is not None:
            self._destroy_server_groups()
            wt.destroy_group(self._update_group)
            self._update_group = None
        self._group_made = False

    def _destroy_server_groups(self) -> None:
        p = self.pusher
        name = self.my_group_name()
        for url in p.server_urls:
            try:
                rollout.control(url, "/destroy_weights_update_group", {"group_name": name},
                                timeout_s=p.timeout_s)
            except rollout.RolloutError:
                pass  # dead, or the group is gone already

    def close(self) -> None:
        """Destroy the update groups (server side first, then this rank's)."""
        self.reset()
