"""The pipe between rank 0 and its rollout producer process (issue 37, item 6), in one process:
the messages' tensors bit for bit (:mod:`pipeline.producer.wire`), calls both ways with their
values and errors, notes, and the other side's end (:mod:`pipeline.producer.endpoint`), the
pool hooks the producer's client calls back (:class:`pipeline.producer.spec.PoolHooks`). The
process itself (a real ``python -m pipeline.producer.worker``): tests/reliability/
test_producer_process.py.

Run: ``.venv/bin/python -m pytest -q tests/unit/test_producer_protocol.py``
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from megatron_gspo.config import config_from_dict
from megatron_gspo.errors import RemoteError
from pipeline.generation.client import RolloutError
from pipeline.engines.factory import ClientSpec, client_spec
from pipeline.producer.endpoint import Endpoint, PeerGone
from pipeline.producer.spec import PoolHooks, ProducerSpec
from pipeline.scoring.data import PromptSampler, TaskPromptDataset
from pipeline.scoring.tasks import AdditionTask
from pipeline.producer.wire import Channel, dumps, loads


def _pipes() -> tuple[Channel, Channel]:
    """Two channels joined as rank 0's and the producer's are (two one-way pipes)."""
    a_in, b_out = os.pipe()
    b_in, a_out = os.pipe()
    a = Channel(Connection(a_in, writable=False), Connection(a_out, readable=False))
    b = Channel(Connection(b_in, writable=False), Connection(b_out, readable=False))
    return a, b


TENSORS = {
    "int64": torch.arange(-5, 7).reshape(3, 4),
    "bf16": torch.randn(4, 3).bfloat16(),
    "float64": torch.randn(5, dtype=torch.float64),
    "bool": torch.tensor([True, False, True]),
    "int16": torch.randint(-3000, 3000, (2, 3, 4), dtype=torch.int16),  # routed experts
    "empty": torch.empty(0, 8),
    "scalar": torch.tensor(2.5),
    "strided": torch.arange(20).reshape(4, 5).t(),  # not contiguous
}


def test_tensors_cross_out_of_band_bit_for_bit():
    message = {"batch": TENSORS, "metrics": {"reward_mean": 0.5}, "step": 3, "none": None}
    data, buffers = dumps(message)
    assert len(buffers) == len(TENSORS)  # every tensor's bytes outside the pickle stream
    assert len(data) < 4096
    back = loads(data, [bytearray(b.raw()) for b in buffers])
    for name, t in TENSORS.items():
        got = back["batch"][name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name
    assert back["metrics"] == {"reward_mean": 0.5} and back["step"] == 3 and back["none"] is None
    back["batch"]["int64"] += 1  # the received tensors own writable memory


def test_a_large_batch_goes_through_the_pipe_whole():
    a, b = _pipes()
    big = {"tokens": torch.randint(0, 151936, (256, 4096)), "lp": torch.randn(256, 4096)}
    got = {}
    reader = threading.Thread(target=lambda: got.update(b.recv()))
    reader.start()
    a.send(big)  # 8 MB: more than a pipe holds, read while written
    reader.join(30)
    assert torch.equal(got["tokens"], big["tokens"]) and torch.equal(got["lp"], big["lp"])
    a.close()
    b.close()


class _Sides:
    """Rank 0 (calls serve on threads) and the producer (calls served in order by ``serve``)."""

    def __init__(self, producer_handlers: dict, rank0_handlers: dict | None = None,
                 notes: dict | None = None):
        a, b = _pipes()
        self.rank0 = Endpoint(a, handlers=rank0_handlers, notes=notes,
                              describe_gone=lambda: "the producer ended").start()
        self.producer = Endpoint(b, handlers=producer_handlers, serial=True,
                                 describe_gone=lambda: "rank 0 ended").start()
        self.server = threading.Thread(target=self.producer.serve, kwargs={"stop_after": ("close",)},
                                       daemon=True)
        self.server.start()

    def close(self):
        self.producer.close()
        self.rank0.close()


def test_calls_return_values_and_raise_the_errors_of_the_other_side():
    def fail(url):
        raise RolloutError(url, 503, "gave up after 5 attempts; last: no workers")

    class Odd(Exception):  # a local class: does not unpickle on the other side
        pass

    def odd():
        raise Odd("a reward's own error")

    sides = _Sides({"add": lambda x, y: x + y, "fail": fail, "odd": odd,
                    "close": lambda: None})
    try:
        assert sides.rank0.call("add", 2, 3) == 5
        with pytest.raises(RolloutError) as err:  # its own type, naming the server
            sides.rank0.call("fail", "http://10.0.0.7:30000")
        assert err.value.url == "http://10.0.0.7:30000" and "gave up" in str(err.value)
        with pytest.raises(RemoteError, match="a reward's own error") as err:
            sides.rank0.call("odd")
        assert err.value.kind == "Odd"
        with pytest.raises(ValueError, match="no call named 'nope'"):
            sides.rank0.call("nope")
        assert sides.rank0.call("add", "a", "b") == "ab"  # it serves on after errors
    finally:
        sides.close()


def test_the_producer_calls_rank0_back_while_serving_a_call():
    """A rollout (served on the producer) waits on rank 0's pool (served on a thread there):
    both directions at once, no deadlock."""
    seen = []
    sides = _Sides({}, rank0_handlers={"wait_for_live": lambda err: seen.append(str(err)) or True})
    hooks = PoolHooks(sides.producer)
    sides.producer._handlers["rollout"] = lambda: hooks.wait_for_live(
        RolloutError("http://s:1", None, "refused"))
    try:
        assert sides.rank0.call("rollout") is True
        assert len(seen) == 1 and "refused" in seen[0]  # the client's error, on rank 0
    finally:
        sides.close()


def test_retried_requests_are_counted_on_rank0():
    counted = []
    sides = _Sides({}, notes={"requests_retried": counted.append})
    hooks = PoolHooks(sides.producer)
    try:
        hooks.requests_retried += 1
        hooks.requests_retried += 1
        deadline = time.monotonic() + 5
        while len(counted) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert counted == [1, 1] and hooks.requests_retried == 2
    finally:
        sides.close()


def test_a_call_waiting_when_the_other_side_ends_raises_instead_of_hanging():
    started = threading.Event()
    sides = _Sides({"forever": lambda: started.set() or time.sleep(3600)})
    box = {}

    def ask():
        try:
            sides.rank0.call("forever")
        except PeerGone as err:
            box["error"] = err
    caller = threading.Thread(target=ask)
    caller.start()
    assert started.wait(10)
    sides.producer._channel.close()  # the producer's end of the pipes goes away
    caller.join(10)
    assert not caller.is_alive()
    assert "the producer ended" in str(box["error"]) and "forever" in str(box["error"])
    with pytest.raises(PeerGone, match="before next"):  # and every later call, at once
        sides.rank0.call("next")
    sides.rank0.close()


def test_serving_ends_after_close_in_order():
    order = []
    sides = _Sides({"a": lambda: order.append("a"), "close": lambda: order.append("close")})
    try:
        sides.rank0.call("a")
        sides.rank0.call("close")
        sides.server.join(5)
        assert not sides.server.is_alive() and order == ["a", "close"]
    finally:
        sides.close()


def test_the_producer_spec_crosses_the_pipe_with_the_samplers_position():
    """What rank 0 sends the producer once: the config, the engine's client spec (the config's
    bounds) and the prompt sampler at its position (the producer draws every prompt after)."""
    cfg = config_from_dict({"rollout": {"async": "one_step", "max_concurrency": 7,
                                        "request_timeout_s": 42.0}})
    sampler = PromptSampler(TaskPromptDataset(AdditionTask(digits=2, seed=0)), seed=3)
    sampler.next_batch(5)
    spec = ProducerSpec(mode="one_step", cfg=cfg, run_dir="/tmp/run", start_step=4,
                        client=client_spec(cfg, "http://router:30000"), sampler=sampler,
                        has_pool=True)
    data, buffers = dumps(("call", 0, "build", (spec,)))
    back = loads(data, [bytearray(b.raw()) for b in buffers])[3][0]
    assert back.client == ClientSpec(router_url="http://router:30000", max_concurrency=7,
                                     request_timeout_s=42.0)
    assert back.cfg == cfg and back.start_step == 4
    assert back.sampler.state_dict() == sampler.state_dict()
    assert back.sampler.next_batch(3) == sampler.next_batch(3)  # the same prompts next
