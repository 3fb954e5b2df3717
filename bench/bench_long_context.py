"""Peak memory per rank on long sequences: context parallelism, activation recompute, and
response-only logits.

Run (several minutes on the 2-core CPU machine; every configuration in fresh processes):

    .venv/bin/python bench/bench_long_context.py cp            # one 8192-token sequence
    .venv/bin/python bench/bench_long_context.py logits        # 151936-entry vocabulary
    .venv/bin/python bench/bench_long_context.py cp --seq-len 16384 --hidden 512

``cp``: one GSPO update (``RLTrainer.train_rollout``: forward-only recompute of log pi_old, then
forward + backward + optimizer step) on a group of 2 sequences of ``--seq-len`` tokens each
(packed, one sequence per micro-batch), under CP1 (1 rank), CP2 (2 ranks, every sequence
zigzag-split) and CP2 with full activation recompute (``model.recompute_granularity: full``,
``uniform``, 1 layer).

``logits``: the same update on a 2048-token sequence (1024 prompt + 1024 response tokens) with a
Qwen3-size vocabulary, the output layer and the vocab-parallel log-probs on every position
(Megatron's default) vs on the response positions only (``logit_index``, what the RL trainer
does).

Peak memory is the process's peak resident set DURING the measured step above its resident set
just before it: the activations, the attention workspace, the logits and gradients the step
creates (a warm-up step first, so that the optimizer state exists before). The peak is Linux's
``VmHWM``, reset before the step through ``/proc/self/clear_refs``; glibc serves every
allocation of 64 KiB or more with mmap (``MALLOC_MMAP_THRESHOLD_``, set for the ranks), so freed
tensors leave the resident set at once and the peak follows the live tensors. The maximum over
ranks is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.spawn import run_on_ranks  # noqa: E402
from megatron_gspo import parallel  # noqa: E402
from megatron_gspo.config import config_from_dict  # noqa: E402
from megatron_gspo.model import gpt as policy  # noqa: E402
from megatron_gspo.train.batching import (add_logit_index, packed_micro_batches,  # noqa: E402
                                          response_counts, rl_batch)
from megatron_gspo.train.rl_loss import make_gspo_loss_fn, make_log_prob_fn  # noqa: E402
from megatron_gspo.train.rl_trainer import RLTrainer  # noqa: E402
from megatron_gspo.train.train_step import build_train_state, forward_backward, train_step  # noqa: E402

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def make_batch(num_sequences: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (prompt,), generator=gen).tolist() for _ in range(num_sequences)]
    outputs = [torch.randint(1, vocab, (response,), generator=gen).tolist() for _ in range(num_sequences)]
    rollout = [[-5.0] * response for _ in range(num_sequences)]
    return rl_batch(prompts, outputs, rollout, torch.tensor([1.0, -1.0] * (num_sequences // 2)),
                    prompt + response - 1, 0)


def _cp_worker(rank, world, cfg_dict, batch):
    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg)
    trainer.train_rollout(batch, 0)  # warm-up: optimizer state
    _reset_peak()
    before = _rss_bytes()
    start = time.process_time()
    trainer.train_rollout(batch, 1)
    seconds = time.process_time() - start
    peak = _peak_rss_bytes()
    parallel.destroy_model_parallel()
    return {"step_peak_mib": (peak - before) / MIB, "seconds": seconds}


def _logits_worker(rank, world, cfg_dict, batch, response_only):
    """One GSPO forward/backward + step through the low-level path (with or without logit_index)."""

    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    gpt = policy.build_model(cfg.model, cfg.parallel, pg)
    policy.init_weights(gpt, cfg.model, pg, seed=0)
    state = build_train_state(gpt, cfg, pg)
    loss_fn = make_gspo_loss_fn(cfg.model, cfg.gspo, pg)

    def step():
        mbs = packed_micro_batches(batch, cfg.run.max_tokens_per_micro_batch, dp_rank=0, dp_size=1)
        mbs = [add_logit_index(mb) if response_only else mb for mb in mbs]
        forward_backward(state, mbs, make_log_prob_fn(cfg.model, pg), num_units_global=1,
                         forward_only=True)
        n = sum(int((response_counts(mb) > 0).sum()) for mb in mbs)
        train_step(state, mbs, loss_fn, num_units_global=n)

    step()  # warm-up
    _reset_peak()
    before = _rss_bytes()
    start = time.process_time()
    step()
    seconds = time.process_time() - start
    peak = _peak_rss_bytes()
    parallel.destroy_model_parallel()
    return {"step_peak_mib": (peak - before) / MIB, "seconds": seconds}


def _model(hidden: int, layers: int, vocab: int, max_pos: int) -> dict:
    heads = max(4, hidden // 64)
    return dict(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=heads // 2, head_dim=64, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=hidden, vocab_size=vocab, max_position_embeddings=max_pos)


def bench_cp(args) -> None:
    prompt = args.seq_len // 4
    batch = make_batch(2, prompt, args.seq_len - prompt + 1, 256)
    model = _model(args.hidden, args.layers, 256, args.seq_len + 8)
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform",
                 "recompute_num_layers": 1}
    runs = [("CP1", 1, {}, {}), ("CP2", 2, {"context": 2}, {}),
            ("CP2 + recompute", 2, {"context": 2}, recompute)]
    print(f"2 sequences of {args.seq_len} tokens (one per micro-batch); model hidden "
          f"{args.hidden}, {args.layers} layers, head_dim 64, 4 experts")
    print(f"{'layout':<16} {'peak MiB/rank':>14} {'step cpu-s/rank':>16}")
    for name, world, section, extra in runs:
        cfg = {"model": {**model, **extra}, "parallel": section,
               "gspo": {"group_size": 2, "updates_per_rollout": 1},
               "run": {"global_batch_size": 2, "micro_batch_size": 1, "seq_length": args.seq_len,
                       "num_steps": 10, "max_tokens_per_micro_batch": args.seq_len // world + 8}}
        results = run_on_ranks(world, _cp_worker, (cfg, batch), timeout_s=1800)
        peak = max(r["step_peak_mib"] for r in results)
        print(f"{name:<16} {peak:>14.0f} {max(r['seconds'] for r in results):>16.1f}", flush=True)


def bench_logits(args) -> None:
    batch = make_batch(2, 1024, 1025, args.vocab)
    model = _model(128, 2, args.vocab, 2100)
    print(f"2 sequences of 2048 tokens (1024 prompt + 1024 response), vocabulary {args.vocab}, "
          "hidden 128, 2 layers")
    print(f"{'logits on':<16} {'peak MiB':>9} {'step cpu-s':>11}")
    for name, response_only in (("every position", False), ("response only", True)):
        cfg = {"model": model, "gspo": {"group_size": 2, "updates_per_rollout": 1},
               "run": {"global_batch_size": 2, "micro_batch_size": 1, "seq_length": 2048,
                       "num_steps": 10, "max_tokens_per_micro_batch": 2048}}
        (result,) = run_on_ranks(1, _logits_worker, (cfg, batch, response_only), timeout_s=1800)
        print(f"{name:<16} {result['step_peak_mib']:>9.0f} {result['seconds']:>11.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    cp = sub.add_parser("cp", help="CP1 vs CP2 vs CP2 + recompute at one long sequence")
    cp.add_argument("--seq-len", type=int, default=8192)
    cp.add_argument("--hidden", type=int, default=256)
    cp.add_argument("--layers", type=int, default=2)
    logits = sub.add_parser("logits", help="output layer on every position vs response only")
    logits.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    # large allocations through mmap: freed tensors leave the resident set (inherited by the ranks)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))
    bench_cp(args) if args.what == "cp" else bench_logits(args)


if __name__ == "__main__":
    main()
