"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

    results = run_on_ranks(world_size=2, fn=my_module_level_fn, args=(...))   # list, by rank

``fn(rank, world_size, *args)`` runs after ``init_process_group("gloo")`` on a free local TCP
port, with ``torch.set_num_threads(1)``; its return value (tensors welcome) comes back through a
file in a private temporary directory (pickle: results are arbitrary objects, written by the
harness's own child processes - the one case where unpickling is safe; nothing here reads a file
it did not create). An exception on any rank is re-raised in the caller as a
``RuntimeError`` naming the rank and carrying its traceback. The process group is destroyed on
every rank, whatever happens. ``fn`` must be importable (module level): it is pickled by name.

The ranks are forked from multiprocessing's fork server, which imports :data:`PRELOAD` (torch,
Megatron-Core, transformers) once per test session and nothing else: a rank starts in ~0.1 s
instead of the ~7 s a spawned interpreter spends importing Megatron-Core on the 2-core machine,
with the same clean state (no process group, no threads, none of this project's modules; the
caller's environment is passed along). Measured: 4 calls of a 2-rank all-reduce, spawn 8.7-25 s
each (load), fork server 5.7 s for the first (the server's imports), 0.1 s after
(``bench/bench_spawn.py``, both in one run).

The benchmarks' and the tests' harness: it lives in bench/ so that bench/ does not import tests/.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


# Imported once by the fork server, so that every rank starts with them in memory instead of
# spending ~7 s (2 cores) importing Megatron-Core again (a spawned rank imports everything anew).
PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
           "transformers")


def _context(start_method: str):
    """``forkserver`` (the default): the fork server with :data:`PRELOAD` imported in it (a fork
    of a process that has imported but not run anything: no threads, no process group);
    ``spawn``: fresh interpreters (bench/bench_spawn.py's baseline)."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _has_failed(proc: mp.Process, out_dir: str, rank: int) -> bool:
    # A failing rank writes a small error file; a successful one may have written big tensors, so
    # only the presence of the error marker is checked here.
    if proc.is_alive():
        return False
    return os.path.exists(os.path.join(out_dir, f"rank{rank}.failed")) or proc.exitcode != 0


def _dump(obj, path: str) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=pickle.HIGHEST_PROTOCOL)


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn: Callable, args: tuple,
            environ: dict[str, str]) -> None:
    # forked from the fork server: its environment is the one the server started with
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        _dump({"ok": True, "result": result}, result_path)
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        _dump({"ok": False, "error": traceback.format_exc()}, result_path)
        open(os.path.join(out_dir, f"rank{rank}.failed"), "w").close()


def run_on_ranks(world_size: int, fn: Callable, args: tuple = (), *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, start_method: str = "forkserver"
                 ) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    if world_size > 4:
        raise ValueError("the test machines have 2 cores: spawn at most 4 ranks")
    ctx = _context(start_method)
    with tempfile.TemporaryDirectory(prefix="gspo_spawn_") as out_dir:
        port = _free_port()
        procs = [
            ctx.Process(target=_worker, args=(rank, world_size, port, out_dir, fn, args, dict(os.environ)),
                        daemon=False)
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        # Wait for all; once one rank has failed the others would block in a collective, so
        # stop them (only the processes started here, by handle) instead of waiting for gloo's
        # timeout.
        deadline = time.monotonic() + timeout_s
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            if any(_has_failed(proc, out_dir, rank) for rank, proc in enumerate(procs)):
                time.sleep(1.0)  # let the other ranks report their own errors if they have any
                break
            time.sleep(0.02)
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in hung:
            procs[rank].kill()
        for proc in procs:
            proc.join()
        errors, results = [], []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if rank in hung:
                errors.append(f"rank {rank}: stopped (timeout {timeout_s:.0f} s or another rank failed)")
            elif not os.path.exists(path):
                errors.append(f"rank {rank}: exited with code {procs[rank].exitcode}, no result")
            else:
                with open(path, "rb") as f:
                    payload = pickle.load(f)
                if payload["ok"]:
                    results.append(payload["result"])
                else:
                    errors.append(f"rank {rank} raised:\n{payload['error']}")
        if errors:
            raise RuntimeError(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(errors))
        return results
