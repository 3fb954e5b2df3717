"""The local rollout server's prefix cache (SGLang's radix cache) on against off, on the CPU.

Run (about 2 minutes on the 2-core CPU machine):

    .venv/bin/python bench/bench_prefix_cache.py

Two ``megatron-gspo serve`` subprocesses of the same random tiny Qwen3-MoE (bench_rollout's
model), one with its prefix cache (the default) and one with ``--disable-radix-cache``, answer the
same two workloads through ``RolloutClient``, interleaved, best of ``--repeats``:

1. **groups**: P prompts x G samples (``generate_groups``, what a GSPO step sends): the G samples
   of a prompt share it, so all but the first find it cached;
2. **multi-turn**: T turns of P x G trajectories, token-in / token-out as ``pipeline.generation.multiturn``
   sends them: turn k's input is turn k-1's input, its output and ``--tool-tokens`` appended
   tokens (a tool's answer), so a turn finds everything but the appended tokens cached.

The last line: ``prefix cache on vs off: groups X.XXx, multi-turn Y.YYx`` (wall-time ratios
measured in this run), with the cached prompt tokens each server reported
(``meta_info.cached_tokens``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def groups_run(url: str, prompts: list[list[int]], args) -> tuple[float, int, int]:
    """(seconds, generated tokens, cached prompt tokens) of one GSPO step's requests."""
    from pipeline.generation.client import RolloutClient, SamplingParams

    client = RolloutClient(server_urls=[url], request_timeout_s=600)
    sp = SamplingParams(max_new_tokens=args.new_tokens)
    t0 = time.perf_counter()
    groups = client.generate_groups(prompts, args.group, sp, seed=11)
    seconds = time.perf_counter() - t0
    flat = [r for g in groups for r in g]
    return seconds, sum(len(r.output_ids) for r in flat), sum(r.cached_tokens for r in flat)


def multiturn_run(url: str, prompts: list[list[int]], args) -> tuple[float, int, int]:
    """(seconds, generated tokens, cached prompt tokens) of T turns of P x G trajectories."""
    from pipeline.generation.client import RolloutClient, SamplingParams

    client = RolloutClient(server_urls=[url], request_timeout_s=600)
    gen = torch.Generator().manual_seed(3)
    inputs = [list(p) for p in prompts for _ in range(args.group)]
    generated = cached = 0
    t0 = time.perf_counter()
    for turn in range(args.turns):
        requests = [(f"t{turn}-{i}", ids, SamplingParams(max_new_tokens=args.new_tokens,
                                                         sampling_seed=1000 * turn + i))
                    for i, ids in enumerate(inputs)]
        results = client.generate_sync(requests)
        generated += sum(len(r.output_ids) for r in results)
        cached += sum(r.cached_tokens for r in results)
        tool = torch.randint(2, args.vocab, (len(inputs), args.tool_tokens), generator=gen)
        inputs = [ids + list(r.output_ids) + tool[i].tolist()
                  for i, (ids, r) in enumerate(zip(inputs, results))]
    return time.perf_counter() - t0, generated, cached


def main() -> None:
    from bench_rollout import add_model_args, make_model
    from bench_rollout import prompts as make_prompts

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--prompts", type=int, default=4, help="P prompts")
    ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tool-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many interleaved runs")
    args = ap.parse_args()
    args.batch = args.prompts  # bench_rollout.prompts' name for the prompt count
    torch.set_num_threads(args.threads)

    from pipeline.servers.cluster import LocalRolloutCluster

    runs: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory(prefix="bench_prefix_cache_") as tmp:
        tmp = Path(tmp)
        model_dir = make_model(tmp / "model", args)
        prompts = make_prompts(args)
        with LocalRolloutCluster(model_dir, 1, router=False, log_dir=tmp / "on",
                                 cpu_threads=args.threads) as on, \
                LocalRolloutCluster(model_dir, 1, router=False, log_dir=tmp / "off",
                                    cpu_threads=args.threads,
                                    server_args=["--disable-radix-cache"]) as off:
            urls = {"on": on.server_urls[0], "off": off.server_urls[0]}
            for url in urls.values():  # warm-up, on prompts that are not measured
                groups_run(url, [list(range(2, 2 + args.prompt_len // 2))], args)
            for _ in range(args.repeats):  # interleaved: both servers see the same load
                for cache, url in urls.items():
                    runs.setdefault(("groups", cache), []).append(groups_run(url, prompts, args))
                    runs.setdefault(("multi-turn", cache), []).append(
                        multiturn_run(url, prompts, args))

    best = {k: min(v) for k, v in runs.items()}
    print(f"\n### Prefix cache on vs off ({datetime.date.today()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} thread(s) per server, load average "
          f"{os.getloadavg()[0]:.1f})\n")
    print(f"Model: bench_rollout's (hidden {args.hidden}, {args.layers} layers, {args.experts} "
          f"experts, vocab {args.vocab}, fp32); {args.prompts} prompts of "
          f"{args.prompt_len // 2}-{args.prompt_len} tokens x G = {args.group}, "
          f"{args.new_tokens} new tokens a request; multi-turn: {args.turns} turns, "
          f"{args.tool_tokens} appended tokens after each. Best of {args.repeats}.\n")
    print("| workload | prefix cache | seconds | generated tokens | cached prompt tokens | speedup |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    ratios = {}
    for workload in ("groups", "multi-turn"):
        ratios[workload] = best[(workload, "off")][0] / best[(workload, "on")][0]
        for cache in ("off", "on"):
            s, n, c = best[(workload, cache)]
            speed = 1.0 if cache == "off" else ratios[workload]
            print(f"| {workload} | {cache} | {s:.2f} | {n} | {c} | {speed:.2f}x |")
    print(f"\nprefix cache on vs off: groups {ratios['groups']:.2f}x, "
          f"multi-turn {ratios['multi-turn']:.2f}x")


if __name__ == "__main__":
    main()
