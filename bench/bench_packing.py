"""Training tokens/s: packed sequences under a token budget vs right-padded rows.

Run (a few minutes on the 2-core CPU machine; each configuration in fresh processes):

    .venv/bin/python bench/bench_packing.py
    .venv/bin/python bench/bench_packing.py --sizes tiny small --rows 64 --repeats 2 --dp 1

What is timed: ``RLTrainer.train_rollout`` itself (the forward-only recompute of log pi_old, then
one GSPO update: forward, backward, optimizer step), on one rollout batch of ``--rows``
sequences whose lengths (prompt + response) are log-normal with a 10x spread (the 5th and 95th
percentiles are 10x apart: sigma = ln 10 / (2 x 1.645)), median ``--median`` tokens, capped at
``--max-len``. Both layouts train on the same batch, with the same token slots per forward:

* padded: rows right-padded to the longest sequence of the batch (the least padding any fixed
  row length allows), ``--micro-batch-size`` rows per micro-batch;
* packed: ``run.max_tokens_per_micro_batch = micro_batch_size x row length``, whole sequences
  packed into each micro-batch (THD), the micro-batches balanced over DP ranks.

Throughput is real tokens (the sequences' own, no padding) per second of the rank's CPU time
for the step (``time.process_time``, one torch thread per rank), median of ``--repeats`` steps
after one warm-up step; the wall time is printed too. CPU time, because the test machine's two
cores are shared and oversubscribed (load average ~20 while these numbers were taken), which
makes wall times swing by 10x between identical steps. The issue's target: packed / padded >= 0.8
x (padded tokens / real tokens), i.e. packing recovers at least 80% of the padding waste.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.spawn import run_on_ranks  # noqa: E402
from megatron_gspo import parallel  # noqa: E402
from megatron_gspo.config import config_from_dict  # noqa: E402
from megatron_gspo.train.batching import rl_batch  # noqa: E402
from megatron_gspo.train.rl_trainer import RLTrainer  # noqa: E402

SIZES = {
    # the CPU demo's policy (launch/configs/tiny_cpu.yaml)
    "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 head_dim=32, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=64),
    # 4x wider, 2x deeper
    "small": dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4,
                  head_dim=32, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256),
}
SPREAD_SIGMA = math.log(10) / (2 * 1.645)


def sample_lengths(rows: int, median: int, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max_len, max(4, round(math.exp(rng.gauss(math.log(median), SPREAD_SIGMA)))))
            for _ in range(rows)]


def make_batch(lengths: list[int], vocab: int, seed: int) -> dict:
    """A rollout batch: a quarter of each sequence is prompt, the rest response."""
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for n in lengths:
        prompt = max(1, (n + 1) // 4)
        ids = torch.randint(1, vocab, (n + 1,), generator=gen).tolist()
        prompts.append(ids[:prompt])
        outputs.append(ids[prompt:])
    rollout = [(-5.0 + 0.1 * torch.randn(len(o), generator=gen)).tolist() for o in outputs]
    advantages = torch.randn(len(lengths), generator=gen)
    return rl_batch(prompts, outputs, rollout, advantages, max(lengths), 0)


def _worker(rank, world, cfg_dict, batch, repeats):
    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg)
    trainer.train_rollout(batch, 0)  # warm-up
    cpu, wall = [], []
    for step in range(1, repeats + 1):
        start = time.process_time()
        wall.append(trainer.train_rollout(batch, step)["train_s"])
        cpu.append(time.process_time() - start)
    parallel.destroy_model_parallel()
    return statistics.median(cpu), statistics.median(wall)


def config(size: str, rows: int, row_length: int, micro_batch_size: int, budget) -> dict:
    return {
        "model": {**SIZES[size], "vocab_size": 256, "max_position_embeddings": 4096},
        "gspo": {"group_size": 8, "updates_per_rollout": 1},
        "optim": {"lr": 1e-4},
        "run": {"global_batch_size": rows, "micro_batch_size": micro_batch_size,
                "seq_length": row_length, "num_steps": 100, "max_tokens_per_micro_batch": budget},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--median", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (spawned)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    lengths = sample_lengths(args.rows, args.median, args.max_len, args.seed)
    batch = make_batch(lengths, 256, args.seed)
    row_length = max(lengths)
    real = sum(lengths)
    padded_tokens = args.rows * row_length
    q05, q95 = sorted(lengths)[len(lengths) // 20], sorted(lengths)[-(len(lengths) // 20) - 1]
    print(f"{args.rows} sequences: lengths {min(lengths)}..{max(lengths)} (median "
          f"{statistics.median(lengths):.0f}, 5%/95% {q05}/{q95}); real tokens {real}, padded "
          f"rows {args.rows} x {row_length} = {padded_tokens} (padding factor "
          f"{padded_tokens / real:.2f}); DP {args.dp}, {args.micro_batch_size} rows or "
          f"{args.micro_batch_size * row_length} tokens per micro-batch")
    print(f"{'size':<6} {'layout':<7} {'cpu s':>8} {'wall s':>8} {'real tok/cpu-s':>15} "
          f"{'speedup':>8} {'target':>7}")
    for size in args.sizes:
        result = {}
        for layout, budget in (("padded", None), ("packed", args.micro_batch_size * row_length)):
            cfg = config(size, args.rows, row_length, args.micro_batch_size, budget)
            times = run_on_ranks(args.dp, _worker, (cfg, batch, args.repeats), timeout_s=3000)
            result[layout] = (max(t[0] for t in times), max(t[1] for t in times))
        for layout in ("padded", "packed"):
            cpu, wall = result[layout]
            speedup = result["padded"][0] / cpu
            target = 0.8 * padded_tokens / real if layout == "packed" else 1.0
            print(f"{size:<6} {layout:<7} {cpu:>8.2f} {wall:>8.2f} {real / cpu:>15.0f} "
                  f"{speedup:>7.2f}x {target:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
