"""How long a test's gloo ranks take to start: spawned interpreters vs the fork server.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_spawn.py --calls 4

Each call of ``bench.spawn.run_on_ranks`` starts 2 ranks that import Megatron-Core's GPT model
(what a distributed test's worker imports) and all-reduce one number; the two start methods
alternate call by call in this one run (the fork server's first call includes its own imports,
reported apart). Prints per method the median seconds per call and the ratio, and this process's
peak RSS (the ranks' memory is theirs, not counted).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.spawn import run_on_ranks  # noqa: E402


def _rank(rank: int, world_size: int) -> float:
    import megatron.core.models.gpt  # noqa: F401 - what a distributed test's rank imports
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4, help="calls per start method")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"spawn": [], "forkserver": []}
    first_forkserver = None
    for i in range(args.calls + 1):
        for method in ("spawn", "forkserver"):
            if method == "spawn" and i == args.calls:
                continue
            start = time.perf_counter()
            assert run_on_ranks(2, _rank, start_method=method) == [2.0, 2.0]
            took = time.perf_counter() - start
            if method == "forkserver" and first_forkserver is None:
                first_forkserver = took  # the server's own imports
            else:
                times[method].append(took)
    spawn, fork = statistics.median(times["spawn"]), statistics.median(times["forkserver"])
    print(f"spawn:       median {spawn:.2f} s per call over {len(times['spawn'])} calls")
    print(f"fork server: median {fork:.3f} s per call over {len(times['forkserver'])} calls "
          f"(its first call, with the server's imports: {first_forkserver:.2f} s)")
    print(f"ratio spawn / fork server: {spawn / fork:.0f}x")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
