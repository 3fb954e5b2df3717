"""``tests.nccl_semantics.NcclSemantics`` itself: collectives return before the data lands.

Run: ``.venv/bin/python -m pytest -q tests/distributed/test_nccl_semantics.py``

On two gloo ranks, inside ``NcclSemantics(delay_s=0.3)``: ``dist.broadcast`` returns in far less
than the delay, and the first read of the tensor waits for it and sees the root's data; an
all-reduce ``wait()``-ed on one group, then a broadcast of the same tensor on another, sends the
reduced value (``wait()`` orders the later call); point-to-point, object and all-gather calls give
gloo's results; afterwards ``ProcessGroup`` is restored (an object all-gather works).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from bench.spawn import run_on_ranks
from tests.nccl_semantics import NcclSemantics

DELAY_S = 0.3


def _worker(rank: int, world_size: int) -> dict:
    other = dist.new_group(backend="gloo")
    out = {}
    with NcclSemantics(delay_s=DELAY_S) as semantics:
        t = torch.full((4,), float(rank + 5))
        t0 = time.monotonic()
        dist.broadcast(t, src=0)
        out["host_s"] = time.monotonic() - t0
        out["value"] = t.tolist()
        out["landed_s"] = time.monotonic() - t0
        x = torch.ones(3) * (rank + 1)
        dist.all_reduce(x)  # default group, wait() at once
        dist.broadcast(x, src=1, group=other)
        out["reduced"] = x.tolist()
        y = torch.zeros(2, dtype=torch.int64)
        if rank == 0:
            dist.send(torch.tensor([7, 8]), dst=1)
        else:
            dist.recv(y, src=0)
        out["received"] = y.numpy().tolist()
        objs = [{"from": 0}] if rank == 0 else [None]
        dist.broadcast_object_list(objs, src=0)
        out["object"] = objs[0]
        z = torch.zeros(4)
        dist.all_gather_into_tensor(z, torch.full((2,), float(rank)))
        out["gathered"] = z.tolist()
        out["calls"] = dict(semantics.calls)
    after = [None, None]
    dist.all_gather_object(after, rank)
    out["after"] = after
    return out


def test_collectives_return_before_the_data_lands():
    for rank, out in enumerate(run_on_ranks(2, _worker)):
        assert out["host_s"] < DELAY_S / 3, out
        assert out["landed_s"] >= DELAY_S, out
        assert out["value"] == [5.0] * 4
        assert out["reduced"] == [3.0] * 3
        assert out["received"] == ([0, 0] if rank == 0 else [7, 8])
        assert out["object"] == {"from": 0}
        assert out["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert out["calls"]["broadcast"] >= 2 and out["calls"]["all_gather_single"] == 1
        assert out["calls"]["allreduce"] == 1
        assert out["after"] == [0, 1]
