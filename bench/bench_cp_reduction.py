"""Bytes and time per step: per-sequence all-reduce (ours) vs all-gathering per-token log-probs over CP.

Run (about a minute on the 2-core CPU machine):

    .venv/bin/python bench/bench_cp_reduction.py
    .venv/bin/python bench/bench_cp_reduction.py --cp 2 4 --seq-lens 4096 16384 65536 --num-sequences 8

To make ``log s_i`` exact when sequence i is split over the ``cp`` ranks of a context-parallel group:

* ours: every rank sums its own tokens per sequence and all-reduces ``[S, K]`` float32 partial sums
  (``SequenceAllReduce``; K = 2 for GSPO: token count and log-ratio sum; ``gspo_loss`` stacks all
  its sums into ONE call, K <= 8 with every optional term). Backward: identity, no communication.
* gather (verl, NeMo-RL, slime): all-gather the per-token log-probs ``[S, T/cp]`` of every rank, so
  every rank sees whole sequences. Backward: each rank keeps its own slice of the gradient (no
  communication if every rank computes the same loss).

Bytes are per rank per micro-batch, forward only (both backwards are free): "payload" is what a rank
contributes, "sent (ring)" what a bandwidth-optimal ring sends per rank: all-reduce
``2 (cp-1)/cp x payload``, all-gather ``(cp-1) x payload``. Time is measured over gloo between
spawned processes on this machine (median of ``--repeats`` calls after a warm-up, each preceded by
a barrier; the slowest rank's median): loopback TCP, so the ratio, not the absolute value, is the
point. On NVLink/InfiniBand the small all-reduce is latency-bound (~10-30 us), the gather
bandwidth-bound.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_gspo.loss.context_parallel import make_sequence_reduce  # noqa: E402
from bench.spawn import run_on_ranks  # noqa: E402

STATS_PER_SEQUENCE = 2  # GSPO: [token count, log-ratio sum]
FLOAT_BYTES = 4


def analytic_bytes(cp: int, seq_len: int, num_sequences: int) -> dict:
    reduce_payload = num_sequences * STATS_PER_SEQUENCE * FLOAT_BYTES
    gather_payload = num_sequences * (seq_len // cp) * FLOAT_BYTES
    return {
        "reduce_payload": reduce_payload,
        "reduce_sent": 2 * (cp - 1) / cp * reduce_payload,
        "gather_payload": gather_payload,
        "gather_sent": (cp - 1) * gather_payload,
    }


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up (connection set-up, allocation)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world_size: int, seq_lens, num_sequences: int, repeats: int) -> dict:
    reduce = make_sequence_reduce(dist.group.WORLD)
    out = {}
    for seq_len in seq_lens:
        local_len = seq_len // world_size
        log_probs_SL = torch.randn(num_sequences, local_len)
        is_response_SL = torch.ones(num_sequences, local_len, dtype=torch.bool)

        def ours():
            # what gspo_loss does before its one sequence_reduce call
            partial_S2 = torch.stack([is_response_SL.sum(-1).float(), (log_probs_SL * is_response_SL).sum(-1)], -1)
            reduce(partial_S2)

        partial_S2 = torch.randn(num_sequences, STATS_PER_SEQUENCE)

        def ours_comm_only():
            reduce(partial_S2)

        gathered = torch.empty(world_size * num_sequences, local_len)
        is_response_gathered = torch.ones(world_size * num_sequences, local_len, dtype=torch.bool)

        def gather_comm_only():
            dist.all_gather_into_tensor(gathered, log_probs_SL)

        def gather():
            # the same sums, over the whole (gathered) sequences: cp times the tokens
            dist.all_gather_into_tensor(gathered, log_probs_SL)
            torch.stack([is_response_gathered.sum(-1).float(), (gathered * is_response_gathered).sum(-1)], -1)

        out[seq_len] = {"reduce_s": _timed(ours, repeats), "reduce_comm_s": _timed(ours_comm_only, repeats),
                        "gather_s": _timed(gather, repeats), "gather_comm_s": _timed(gather_comm_only, repeats)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--num-sequences", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()

    rows = []
    for cp in args.cp:
        per_rank = run_on_ranks(cp, _worker, args=(args.seq_lens, args.num_sequences, args.repeats), timeout_s=600)
        for seq_len in args.seq_lens:
            times = {k: max(r[seq_len][k] for r in per_rank)
                     for k in ("reduce_s", "reduce_comm_s", "gather_s", "gather_comm_s")}
            rows.append((cp, seq_len, analytic_bytes(cp, seq_len, args.num_sequences), times))

    print(f"\n{args.num_sequences} sequences per micro-batch, float32, gloo over loopback, "
          f"{os.cpu_count()} CPU cores, {datetime.date.today().isoformat()}\n")
    print("| cp | tokens/seq | ours: payload / sent (B) | gather: payload / sent (B) | bytes sent: gather / ours "
          "| ours: total / comm (us) | gather: total / comm (us) | time: gather / ours (total) | (comm) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cp, seq_len, b, t in rows:
        print(f"| {cp} | {seq_len} | {b['reduce_payload']} / {b['reduce_sent']:.0f} | "
              f"{b['gather_payload']} / {b['gather_sent']:.0f} | {b['gather_sent'] / b['reduce_sent']:.0f}x | "
              f"{t['reduce_s'] * 1e6:.0f} / {t['reduce_comm_s'] * 1e6:.0f} | "
              f"{t['gather_s'] * 1e6:.0f} / {t['gather_comm_s'] * 1e6:.0f} | "
              f"{t['gather_s'] / t['reduce_s']:.2f}x | {t['gather_comm_s'] / t['reduce_comm_s']:.2f}x |")
    print("\ntotal = until every rank has the exact per-sequence sums: ours = local sums + all_reduce([S, 2]);")
    print("gather = all_gather_into_tensor([S, T/cp]) + the same sums over whole sequences. comm = collective only.")
    print("time = slowest rank's median over the repeats; cp=4 runs 4 processes on the machine's cores.")
    print("reproduce: .venv/bin/python bench/bench_cp_reduction.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
