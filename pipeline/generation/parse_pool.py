"""The rollout client's parse process: large ``/generate`` answers are read outside the training
process.

A rollout thread that shares a process with other work (before issue 37 item 6: rank 0's
rollout thread under ``rollout.async: one_step`` / ``full``, beside the main thread that runs -
on GPUs: launches - the training step; now that rollout runs in a producer process of its own,
``pipeline.sources.remote``, and this pool serves it there) shares one interpreter lock with it.
Reading an answer in Python (``json.loads`` of ``[log-prob, token id, text]`` per output token,
then the checks and lists of ``pipeline.generation.answers``) holds that lock: a 30B step's ~2M
tokens took 2.6 s of CPU here, and the training step that ran beside it 1.6-2.3x as long
(``bench/bench_rollout_thread.py``: the thread and the step hand the lock back and forth; with
this pool 1.3-1.6x, docs/performance.md).

So an answer of at least :data:`MIN_BYTES` is handed, as the bytes read off the socket, to a
helper process (:class:`ParsePool`: a ``ProcessPoolExecutor`` of spawned workers that die with
their parent and ignore the job's stop signals, ``megatron_gspo.lifetime.shielded_helper``) that
runs :func:`~pipeline.generation.answers.read_answer` and sends back the compact
:class:`~pipeline.generation.answers.Answer` (numpy arrays); the client builds the sample's lists
from it (``ndarray.tolist``, C speed). Smaller answers (the CPU runs' tens of tokens) are read in
the thread: a process round trip costs more than they do, and no run with short answers starts
the process. One pool per process (:func:`shared_pool`), started at its first large answer.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
from typing import Optional

from megatron_gspo.lifetime import on_a_lasting_thread, shielded_helper
from pipeline.generation.answers import Answer, read_answer

MIN_BYTES = 64 << 10
"""Answers of at least this many bytes are read in the parse process (~1,500 output tokens with
their log-probs); smaller ones in the calling thread."""
WORKERS = 1
"""Parse processes: one reads a 30B step's 2M tokens in ~2.6 s of CPU, far less than the
rollout that produces them."""


class ParsePool:
    """``submit`` answers to the parse process(es); each future's result is an :class:`Answer`
    (or it raises :class:`~pipeline.generation.answers.Malformed`, as in the thread)."""

    def __init__(self, workers: int = WORKERS):
        self.workers = workers
        self.answers = 0
        """Answers submitted so far."""
        self._executor: Optional[concurrent.futures.ProcessPoolExecutor] = None
        self._lock = threading.Lock()

    def _pool(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                # its processes die with this process (PR_SET_PDEATHSIG), so they are started
                # from a thread that lasts as long: started from the caller's (a one_step
                # rollout's thread, one per step), they died when that rollout ended and the
                # next step's answers met a BrokenProcessPool
                self._executor = on_a_lasting_thread(self._start)
            self.answers += 1
            return self._executor

    def _start(self) -> concurrent.futures.ProcessPoolExecutor:
        """The executor with its worker processes started (on this thread)."""
        executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=shielded_helper)
        for ready in [executor.submit(os.getpid) for _ in range(self.workers)]:
            ready.result()
        return executor

    def submit(self, raw: bytes, rid: str, prompt_len: int,
               routed_experts: Optional[tuple[int, int]] = None
               ) -> "concurrent.futures.Future[Answer]":
        return self._pool().submit(read_answer, raw, rid, prompt_len, routed_experts)

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)


_shared: Optional[ParsePool] = None
_shared_lock = threading.Lock()


def shared_pool() -> ParsePool:
    """This process's pool (made at the first call; its process starts at the first answer)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = ParsePool()
        return _shared
