"""The batch source of ``rollout.async: one_step`` and ``full`` in a run: the rollout producer in a
process of its own, so that rank 0's training process only trains.

Rank 0's rollout used to run on a thread of the training process (``pipeline.sources.one_step``,
``pipeline.sources.stream``): its HTTP, the parsing of ~2M per-token log-probs per 30B step and
the building of the batch held the interpreter lock that rank 0's main thread needs to launch the
kernels every pipeline and expert peer waits on; the same training step took 1.6-2.0x as long
beside it (``bench/bench_rollout_thread.py``, docs/performance.md). :class:`RemoteSource` runs
that same source in ``python -m pipeline.producer.worker`` and forwards the
:class:`~pipeline.sources.base.BatchSource` methods to it over two pipes
(:mod:`pipeline.producer.endpoint`); batches come back as tensors, each one frame of raw bytes
(:mod:`pipeline.producer.wire`). The step sees the same protocol, the same batches, metrics and
run states (the resume matrix, the staleness bound, partial samples in ``full``: all the
source's own, unchanged).

What stays on rank 0: the server pool (dead servers, their restarts and the resync of a
restarted server through every rank, the router's re-admission): the producer's client calls its
hooks back here (``wait_for_live``, ``wait_for_router``, served on threads of this process), and
the weight pusher (it needs the ranks). Rank 0 forwards a stop signal (the note ``interrupt``:
the producer's reward function and tool calls are abandoned, as on rank 0 before).

Lifetime: started at the first use (:meth:`restore`, or :meth:`start`), before the first weight
sync; it blocks the stop signals (the checkpoint a SIGTERM writes asks it for the source's state
first), dies with rank 0 (PR_SET_PDEATHSIG), and :meth:`close` ends it (then SIGKILL after
:data:`CLOSE_TIMEOUT_S`). An error in it reaches the step as the error it raised (a
``RolloutError`` naming its server, a reward's error, the stream's ``TimeoutError``: the same
line on every rank through ``pipeline.step.rank0.on_main``); its end while rank 0 waits as
:class:`ProducerGone` naming the process and its exit.

``rollout.async: off`` keeps its rollout in the training process (``pipeline.sources.sync``):
there it never overlaps training (every rank waits for it), so the process boundary would only
add the batch's trip through the pipe.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
from typing import Any, Optional

from pipeline.context import LoopContext
from pipeline.engines.factory import ClientSpec
from pipeline.producer.endpoint import Endpoint, PeerGone
from pipeline.producer.spec import IN_PROCESS, ProducerSpec
from pipeline.producer.wire import Channel
from pipeline.scoring.rewards import start_piped_worker

PIPE_BYTES = 1 << 20
"""The producer's pipes' capacity (Linux's default is 64 kB; 1 MB is the unprivileged bound)."""
CLOSE_TIMEOUT_S = 60.0
"""How long :meth:`RemoteSource.close` waits for the producer to stop its rollouts and exit."""


class ProducerGone(PeerGone):
    """The producer process ended while rank 0 needed it."""


class RemoteSource:
    """:class:`pipeline.sources.base.BatchSource` of ``mode`` (``one_step`` / ``full``), served by a
    producer process; see the module docstring. ``engine``: how the producer builds its client
    (``LoopContext.engine``)."""

    def __init__(self, ctx: LoopContext, start_step: int, *, mode: str, engine: ClientSpec):
        if mode not in IN_PROCESS:
            raise ValueError(f"RemoteSource: no producer for rollout.async: {mode}")
        self.mode = mode
        self._ctx, self._start_step, self._engine = ctx, start_step, engine
        self._proc: Optional[subprocess.Popen] = None
        self._endpoint: Optional[Endpoint] = None
        self._interrupt_sent = False
        self._deferred: Optional[BaseException] = None
        self._busy_s = 0.0
        self.pid: Optional[int] = None
        """The producer's process id (None before it starts)."""

    # --- the process
    def _producer(self) -> Endpoint:
        if self._endpoint is not None:
            return self._endpoint
        ctx = self._ctx
        self._proc, inbox, outbox = start_piped_worker(
            "pipeline.producer.worker",
            lambda fd_in, fd_out: [str(fd_in), str(fd_out), str(os.getpid())])
        pool = ctx.servers
        handlers = {} if pool is None else {"wait_for_live": pool.wait_for_live,
                                            "wait_for_router": pool.wait_for_router}
        for conn in (inbox, outbox):  # a batch is tens of MB: fewer, larger pipe writes
            _widen_pipe(conn.fileno())
        self._endpoint = Endpoint(Channel(inbox, outbox), handlers=handlers,
                                  notes={"requests_retried": self._count_retried},
                                  on_idle=self._forward_stop, describe_gone=self._describe_end)
        self._endpoint.start()
        spec = ProducerSpec(mode=self.mode, cfg=ctx.cfg, run_dir=ctx.run_dir,
                            start_step=self._start_step, client=self._engine,
                            sampler=ctx.sampler, has_pool=pool is not None)
        self.pid = self._call("build", spec)
        print(f"rollout producer: process {self.pid} (rollout.async: {self.mode})", flush=True)
        return self._endpoint

    def _call(self, name: str, *args: Any) -> Any:
        if self._deferred is not None:  # what failed outside a phase fails the next one
            error, self._deferred = self._deferred, None
            raise error
        try:
            return self._endpoint.call(name, *args)
        except PeerGone as err:
            raise ProducerGone(str(err)) from None
        except Exception as err:
            err.add_note("rollout producer process")
            raise

    def _describe_end(self) -> str:
        proc = self._proc
        code = None
        if proc is not None:
            try:
                code = proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                code = None
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            try:
                how = f"killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        pid = proc.pid if proc is not None else "?"
        return (f"the rollout producer process (pid {pid}, rollout.async: {self.mode}) ended "
                f"({how}; its output is in rank 0's log)")

    def _count_retried(self, delta: int) -> None:
        if self._ctx.servers is not None:
            self._ctx.servers.requests_retried += delta

    def _forward_stop(self) -> None:
        if not self._interrupt_sent and self._ctx.stop.signum is not None:
            self._interrupt_sent = True
            self._endpoint.note("interrupt")

    # --- the batch source
    def restore(self, saved: dict) -> None:
        self._producer()
        self._call("restore", saved)

    def _outside_a_phase(self, name: str, *args: Any, default: Any = None) -> Any:
        """A call the step makes on rank 0 alone, outside ``on_main`` (``start``,
        ``weights_changed``, ``busy_s``): raising there would leave the other ranks waiting in
        their next collective, so its error is kept and raised by the next call, inside a phase
        (the thread's versions of these never raised)."""
        try:
            self._producer()
            return self._call(name, *args)
        except Exception as err:  # noqa: BLE001 - raised by the next call, on every rank
            self._deferred = self._deferred or err
            return default

    def start(self) -> None:
        self._outside_a_phase("start")

    def next(self, step: int) -> tuple[dict, dict]:
        self._producer()
        return self._call("next", step)

    def before_weights_change(self) -> dict:
        self._producer()
        return self._call("before_weights_change")

    def weights_changed(self, version: int) -> None:
        self._outside_a_phase("weights_changed", version)

    def state(self) -> dict:
        self._producer()
        return self._call("state")

    def busy_s(self) -> float:
        """0 before the producer starts (every rank asks; only rank 0's starts it); the last
        value when the producer cannot answer (its error then fails the next phase)."""
        if self._endpoint is not None:
            self._busy_s = self._outside_a_phase("busy_s", default=self._busy_s)
        return self._busy_s

    def close(self) -> None:
        """The producer stops its rollouts and exits (killed if it does not within
        :data:`CLOSE_TIMEOUT_S`); a no-op where it never started."""
        endpoint, proc = self._endpoint, self._proc
        if endpoint is None or proc is None:
            return
        self._endpoint = None
        if endpoint.gone is None:
            try:
                endpoint.call("close")
            except Exception as err:  # noqa: BLE001 - the run ends anyway; say why it was unclean
                print(f"rollout producer: close: {type(err).__name__}: {err}", flush=True)
        try:
            proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: it and what it started
            proc.wait()
        endpoint.close()


def _widen_pipe(fd: int) -> None:
    """Give the pipe ``fd`` :data:`PIPE_BYTES` of buffer where the system allows (a 60 MB batch
    then crosses in ~60 writes instead of ~1,000 hand-offs between the two processes)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, AttributeError):  # a lower pipe-max-size, or not Linux: the default
        pass
