"""A failed weight push fails alike on every rank, as types (``pipeline.weights.push``): the
same :class:`WeightPushError` message everywhere (naming the server, the call and the rank),
raised from the error behind it as its own type (``RolloutError``), after rank 0 resumed
generation. Two gloo ranks, each with a two-bucket stream (bucket 0 on rank 0, bucket 1 on
rank 1), the ``tensor`` transport, and a stand-in server behind ``client.http_json``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench.spawn import run_on_ranks
from pipeline.generation import client
from pipeline.weights.push import WeightPusher, WeightPushError

URL = "http://server-a"
RESUMED = ("; generation resumed on every server (weights may be half-updated: the next push is "
           "a full one)")


class _Stream:
    """The duck-typed bucket stream ``WeightPusher.push`` iterates: one float32 tensor per
    bucket, bucket i on rank i."""

    def __init__(self, world_size: int):
        self.buckets = []
        for i in range(world_size):
            values = torch.arange(4, dtype=torch.float32) + 10 * i
            flat = values.view(torch.uint8).clone()
            self.buckets.append(SimpleNamespace(
                index=i, count=world_size, source=i, names=[f"w{i}"], shapes=[(4,)],
                dtype=torch.float32, nbytes=flat.numel(), flat=flat,
                named_tensors=lambda flat=flat, i=i: [(f"w{i}", flat.view(torch.float32))]))
        self.meta = self.buckets
        self.sources = list(range(world_size))
        self.num_tensors = world_size
        self.total_bytes = sum(b.nbytes for b in self.buckets)
        self.dtype = torch.float32

    def __len__(self) -> int:
        return len(self.buckets)

    def __iter__(self):
        return iter(self.buckets)


def _push_on_rank(rank: int, world_size: int, failing: str, failing_rank: int) -> dict:
    """One push with ``failing`` (a server path) answering HTTP 500 when called on
    ``failing_rank``: what the push raised on this rank, and the server calls it made."""
    calls: list[str] = []

    def http_json(method, url, body=None, *, timeout_s, headers=None):
        path = url[len(URL):]
        calls.append(path)
        if path == failing and rank == failing_rank:
            return 500, {"error": f"boom from {path}"}
        if path == "/server_info":
            return 200, {"tp_size": 1, "dp_size": 1}
        return 200, {"success": True}

    client.http_json = http_json
    pusher = WeightPusher([URL], transport="tensor", verify=False, timeout_s=5.0)
    try:
        stats = pusher.push(_Stream(world_size), version="3")
        return {"raised": None, "stats": stats.num_buckets, "calls": calls}
    except WeightPushError as err:
        cause = err.__cause__
        return {"raised": type(err).__name__, "message": str(err), "calls": calls,
                "cause": type(cause).__name__, "cause_message": str(cause),
                "cause_status": getattr(cause, "status", None)}
    finally:
        pusher.close()


def test_a_push_without_failures_returns_its_stats_on_every_rank():
    results = run_on_ranks(2, _push_on_rank, ("", -1))
    assert [r["raised"] for r in results] == [None, None]
    assert [r["stats"] for r in results] == [2, 2]


@pytest.mark.parametrize("failing,failing_rank,where", [
    ("/update_weights_from_tensor", 1, "rank 1, bucket 1: "),  # a source's send, gathered
    ("/pause_generation", 0, ""),  # rank 0's first step, broadcast
    ("/update_weight_version", 0, ""),  # rank 0's last step
])
def test_a_failed_push_raises_the_same_error_on_every_rank_from_its_cause(failing, failing_rank,
                                                                          where):
    results = run_on_ranks(2, _push_on_rank, (failing, failing_rank))
    said = f"{URL}{failing}: HTTP 500: boom from {failing}"
    expected = (f"weight sync of version 3 to ['{URL}'] failed: {where}RolloutError: {said}"
                + RESUMED)
    for rank, got in enumerate(results):
        assert got["raised"] == "WeightPushError", (rank, got)
        assert got["message"] == expected, (rank, got["message"])
        # the error behind it crossed ranks as its own type, with its fields
        assert (got["cause"], got["cause_message"], got["cause_status"]) == \
            ("RolloutError", said, 500), (rank, got)
    assert results[0]["calls"][-1] == "/continue_generation"  # rank 0 resumed generation
