"""The rollout producer process of ``rollout.async: one_step`` and ``full`` (rank 0 starts it:
``pipeline.sources.remote.RemoteSource``).

    python -m pipeline.producer.worker FD_IN FD_OUT OWNER_PID

It talks to rank 0 over two pipes (:mod:`pipeline.producer.endpoint`). The first call is
``build(spec)`` (a :class:`~pipeline.producer.spec.ProducerSpec`); then it serves the batch
source's methods (``restore``, ``start``, ``next``, ``before_weights_change``,
``weights_changed``, ``state``, ``busy_s``) one at a time, in order, until ``close`` or the end
of the pipe. The source runs its rollouts as it did on rank 0: a thread (``one_step``), an event
loop on a thread (``full``); their HTTP, the parsing of the answers, the rewards, the batches are
this process's CPU, not the training process's.

Its lifetime is rank 0's, as the reward worker's (``pipeline.scoring.reward_worker``): it blocks
the stop signals (a SIGTERM that reaches the whole job is rank 0's to act on: it checkpoints,
asking this process for the stream's state, then closes it), dies by SIGKILL with its owner
(PR_SET_PDEATHSIG; it exits at once if the owner is already gone), and ends when the pipe does.
A stop signal on rank 0 reaches it as the note ``interrupt``: its reward function and tool calls
are abandoned then, as on rank 0 before.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Optional

from megatron_gspo.lifetime import STOP_SIGNALS, die_with_parent, shield_from_stop_signals
from pipeline.producer.endpoint import Endpoint
from pipeline.producer.spec import PoolHooks, ProducerSpec, build_producer
from pipeline.producer.wire import Channel
from pipeline.sources.base import BatchSource

SOURCE_CALLS = ("restore", "start", "next", "before_weights_change", "weights_changed", "state",
                "busy_s")
"""The batch source's methods rank 0 calls here (``pipeline.sources.base.BatchSource``)."""


class Producer:
    """The calls this process serves: ``build`` once, then the source's methods, then ``close``."""

    def __init__(self) -> None:
        self.interrupted = threading.Event()
        self.endpoint: Optional[Endpoint] = None
        self._source: Optional[BatchSource] = None
        self._ctx = None

    def handlers(self) -> dict:
        calls = {name: self._forward(name) for name in SOURCE_CALLS}
        return {**calls, "build": self.build, "close": self.close, "pid": os.getpid}

    def build(self, spec: ProducerSpec) -> int:
        if self._source is not None:
            raise RuntimeError("the producer is built already")
        hooks = PoolHooks(self.endpoint) if spec.has_pool else None
        self._source, self._ctx = build_producer(spec, servers=hooks,
                                                 interrupted=self.interrupted.is_set)
        return os.getpid()

    def _forward(self, name: str):
        def call(*args: Any) -> Any:
            if self._source is None:
                raise RuntimeError(f"{name}: the producer is not built yet")
            return getattr(self._source, name)(*args)
        return call

    def close(self) -> None:
        """Stop what runs (the source's rollouts, the generator's workers)."""
        if self._source is not None:
            self._source.close()
        close = getattr(self._ctx.generator, "close", None) if self._ctx is not None else None
        if close is not None:
            close()


def main(argv: list[str]) -> int:
    fd_in, fd_out, owner = int(argv[0]), int(argv[1]), int(argv[2])
    die_with_parent()
    shield_from_stop_signals()
    # the imports above started a native thread (torch's) before the mask: a stop signal sent
    # to the process would reach it there; ignored, it reaches no thread (nothing here installs
    # a handler later: the stream's event loop runs on a thread of its own)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if os.getppid() != owner:  # the owner died before the parent-death signal was armed
        return 1
    channel = Channel(Connection(fd_in, writable=False), Connection(fd_out, readable=False))
    producer = Producer()
    endpoint = Endpoint(channel, handlers=producer.handlers(), serial=True,
                        notes={"interrupt": producer.interrupted.set},
                        describe_gone=lambda: "rank 0 closed the pipe")
    producer.endpoint = endpoint
    endpoint.start()
    try:
        endpoint.serve(stop_after=("close",))
    finally:
        if endpoint.gone is not None:  # rank 0 went away without a close: stop anyway
            producer.close()
        channel.close()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the rollouts' threads and executors are stopped or not needed: no joins
