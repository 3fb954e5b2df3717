"""What rank 0's rollout thread costs rank 0's training step (issue 37, item 6).

Under ``rollout.async: one_step`` and ``full`` rank 0 runs the rollout client on a thread of the
training process while its main thread trains (and, on GPUs, launches the kernels every pipeline
and expert peer waits on). The client turns every ``/generate`` answer into a ``RolloutResult``
in Python: the JSON text of ``output_token_logprobs`` (``[logprob, token id, null]`` per token)
and the checks and lists of ``pipeline.generation.client.parse_generate_response``. This bench
times the same training step with that thread idle, parsing one 30B-sized batch of answers
itself (the client before issue 37), and handing it to the client's parse process (the client
now), in one process, the three arms interleaved (each first, second and third in turn):

* the step: ``RLTrainer.train_rollout`` (recompute of log pi_old + 2 GSPO updates) of a Qwen3-MoE
  of hidden 128, 4 layers, 16 experts top-2 on real Megatron-Core (gloo, world 1), a packed batch
  of 64 sequences of 60-290 tokens, one torch thread (``bench/bench_kernels.py``'s step);
* the answers: ``--samples`` x ``--tokens`` (default 512 x 4096: the 30B recipe's 256 samples of
  up to 8,192 tokens, ~2M tokens per step) in SGLang 0.5.23's ``/generate`` format (``text``,
  ``output_ids``, ``meta_info`` with ``output_token_logprobs`` of float32 values, weight-version
  spans, ...), rendered as SGLang renders them (``pipeline.local.bodies.render_json``), as the
  bytes the client reads off its sockets;
* parsing in the thread: the client's own code on every answer (``parse_generate_text``:
  ``json.loads`` of the bytes, the checks, the sample's lists), started with the step; parsing in
  the process: the bytes to the parse process (``pipeline.generation.parse_pool``), the sample's
  lists built from its compact answers (``answer_result``), as ``read_generate_answer`` does.

Also reported: each parse alone (no step: wall seconds, and CPU seconds of the training process:
the parse process's own are not in it), and the training process's memory for one batch
(tracemalloc: its peak while parsing, what the samples keep).

Run (about 6 minutes on the 2-core machine)::

    nice -n 19 .venv/bin/python bench/bench_rollout_thread.py --repeats 6

The arms run under the same conditions (one process, interleaved), so the ratios are fair even
on a loaded machine; the absolute seconds are this CPU's. Numbers: docs/performance.md, "The rollout
thread and rank 0's training step".
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_packing import make_batch  # noqa: E402
from bench.spawn import run_on_ranks  # noqa: E402
from megatron_gspo import parallel  # noqa: E402
from megatron_gspo.config import config_from_dict  # noqa: E402
from megatron_gspo.train.rl_trainer import RLTrainer  # noqa: E402
from pipeline.generation.client import answer_result, parse_generate_text  # noqa: E402
from pipeline.generation.parse_pool import ParsePool  # noqa: E402
from pipeline.local.bodies import render_json  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
             head_dim=32, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=128,
             vocab_size=256, max_position_embeddings=4096)
VOCAB = 151936  # Qwen3's: token ids of up to 6 digits in the JSON
PROMPT_TOKENS = 300
URL = "http://10.0.0.1:30000"


def make_bodies(samples: int, tokens: int, seed: int) -> list[bytes]:
    """``samples`` answers of ``tokens`` output tokens each, as SGLang 0.5.23 renders them."""
    rng = np.random.default_rng(seed)
    bodies = []
    for i in range(samples):
        ids = rng.integers(0, VOCAB, tokens).tolist()
        # float32 log-probs (what SGLang's sampler returns), mostly near 0, a long tail
        lps = (-rng.exponential(0.4, tokens)).astype(np.float32).astype(np.float64).tolist()
        meta = {"id": f"b{i}", "finish_reason": {"type": "length", "length": tokens},
                "prompt_tokens": PROMPT_TOKENS, "weight_version": "7", "num_retractions": 0,
                "input_token_logprobs": [[None, 11, None]],
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                "output_token_logprobs_length": tokens, "completion_tokens": tokens,
                "reasoning_tokens": 0, "cached_tokens": 0,
                "weight_versions": [{"version": "7", "start": 0, "end": tokens}],
                "cached_tokens_details": None, "dp_rank": 0, "e2e_latency": 61.5,
                "response_sent_to_client_ts": 1.7e9}
        text = "".join(chr(97 + t % 26) * 4 for t in ids[:tokens])  # ~4 characters a token
        bodies.append(render_json({"text": text, "output_ids": ids, "meta_info": meta}))
    return bodies


def parse_in_thread(bodies: list[bytes]) -> list:
    """What the client does with each answer on its thread (``resp.text()`` decodes UTF-8)."""
    prompt = list(range(PROMPT_TOKENS))
    return [parse_generate_text(b.decode("utf-8"), f"b{i}", prompt, URL)
            for i, b in enumerate(bodies)]


def parse_in_process(pool: ParsePool, bodies: list[bytes]) -> list:
    """What the client does with each answer now: the bytes to the parse process, the sample's
    lists built from its compact answer (``read_generate_answer``, without the event loop)."""
    prompt = list(range(PROMPT_TOKENS))
    futures = [pool.submit(b, f"b{i}", PROMPT_TOKENS) for i, b in enumerate(bodies)]
    return [answer_result(f.result(), f"b{i}", prompt, URL) for i, f in enumerate(futures)]


ARMS = ("idle", "thread", "process")
"""idle: the rollout thread waits; thread: it parses the batch itself (the client before issue
37); process: it hands the batch to the parse process (the client now)."""


def _step_worker(rank, world, cfg_dict, batch, bodies, repeats):
    torch.set_num_threads(1)
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg)
    pool = ParsePool()
    parsers = {"thread": lambda: parse_in_thread(bodies),
               "process": lambda: parse_in_process(pool, bodies)}
    steps = iter(range(10**6))
    trainer.train_rollout(batch, next(steps))  # warm-up: allocator, kernels, the parse process
    alone = {}
    for name, parse in parsers.items():  # each parse alone, nothing else running
        parse()
        runs = []
        for _ in range(2):
            t0, c0 = time.perf_counter(), time.process_time()
            parse()
            runs.append((time.perf_counter() - t0, time.process_time() - c0))
        alone[name] = min(runs)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    parse_s: dict[str, list[float]] = {"thread": [], "process": []}
    for r in range(repeats):
        order = ARMS[r % 3:] + ARMS[:r % 3]  # each arm first, second and third in turn
        for arm in order:
            gc.collect()
            done = threading.Event()
            box: dict = {}

            def rollout_thread():
                if arm != "idle":
                    t0 = time.perf_counter()
                    box["results"] = parsers[arm]()
                    box["seconds"] = time.perf_counter() - t0
                done.wait()

            thread = threading.Thread(target=rollout_thread, daemon=True)
            thread.start()
            t0 = time.perf_counter()
            trainer.train_rollout(batch, next(steps))
            times[arm].append(time.perf_counter() - t0)
            done.set()
            thread.join()
            if arm != "idle":
                parse_s[arm].append(box["seconds"])
    memory = {name: _memory(parse) for name, parse in parsers.items()}
    pool.close()
    parallel.destroy_model_parallel()
    return {"times": times, "parse_in_step_s": parse_s, "alone": alone, "memory": memory}


def _memory(parse) -> dict:
    """tracemalloc over one batch: the peak while parsing and what the results keep."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    results = parse()
    kept, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    tokens = sum(len(r.output_ids) for r in results)
    return {"peak_mb": (peak - base) / 1e6, "kept_mb": (kept - base) / 1e6, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=6, help="steps per arm (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the raw numbers here")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    lengths = [rng.randint(60, 290) for _ in range(64)]
    batch = make_batch(lengths, 256, args.seed)
    cfg = {"model": MODEL,
           "gspo": {"group_size": 8, "updates_per_rollout": 2, "routing_metrics": False},
           "optim": {"lr": 1e-4},
           "run": {"global_batch_size": len(lengths), "micro_batch_size": 16,
                   "seq_length": max(lengths), "num_steps": 100,
                   "max_tokens_per_micro_batch": 4096}}
    t0 = time.perf_counter()
    bodies = make_bodies(args.samples, args.tokens, args.seed)
    size = sum(len(b) for b in bodies)
    print(f"# {args.samples} answers x {args.tokens} tokens: {size / 1e6:.1f} MB of JSON "
          f"({size / args.samples / 1e3:.0f} kB each), built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    out = run_on_ranks(1, _step_worker, (cfg, batch, bodies, args.repeats), timeout_s=3600)[0]
    idle = statistics.median(out["times"]["idle"])
    print("| rollout thread | step (s, median) | vs idle | parse alone: wall / CPU of the "
          "training process (s) | parse during the step (s) | training process memory while "
          "parsing: peak / kept (MB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for arm in ARMS:
        step = statistics.median(out["times"][arm])
        if arm == "idle":
            print(f"| idle | {step:.2f} | 1.000 | - | - | - |")
            continue
        wall, cpu = out["alone"][arm]
        mem = out["memory"][arm]
        print(f"| parsing in the {arm} | {step:.2f} | {step / idle:.3f} | {wall:.2f} / {cpu:.2f} | "
              f"{statistics.median(out['parse_in_step_s'][arm]):.2f} | "
              f"{mem['peak_mb']:.0f} / {mem['kept_mb']:.0f} |")
    print("# steps: " + "; ".join(f"{arm} {[round(x, 2) for x in out['times'][arm]]}"
                                  for arm in ARMS))
    print("rollout thread vs idle: " + ", ".join(
        f"parsing in the {arm} {statistics.median(out['times'][arm]) / idle:.3f}x"
        for arm in ARMS[1:]) + f" the step ({args.samples} x {args.tokens} tokens per step)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **out}, indent=1))


if __name__ == "__main__":
    main()
