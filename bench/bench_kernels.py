"""The CPU hot paths of one RL step, each against the implementation it replaced, in one run.

Run (about 3 minutes on the 2-core CPU machine; one torch thread per process)::

    .venv/bin/python bench/bench_kernels.py
    .venv/bin/python bench/bench_kernels.py --seqs 64 --min-len 60 --max-len 290 --repeats 3

Every row is timed in this run against its baseline (best of ``--repeats``; CPU time where one
process does the work, wall time where several do):

1. **Core attention of the training step** (``megatron_gspo.model.attention.causal_attention``,
   forward + backward, float32): the plain-torch blockwise kernel (what every layout used before,
   and what context parallelism still uses) vs PyTorch's fused SDPA per sequence (the kernel
   ``"auto"`` picks without CP). A packed micro-batch of ``--seqs`` sequences of uniform random
   lengths in ``[--min-len, --max-len]``.
2. **The training step** (``RLTrainer.train_rollout``: recompute of log pi_old and 2 GSPO updates,
   world 1, packed micro-batches of 4096 tokens) of a Qwen3-MoE of hidden 128, 4 layers, 16 experts
   top-2, on the same lengths: blockwise attention forced vs the default (SDPA).
3. **The local rollout server's decoding** (``LocalEngine``, 64 rows, per-row lengths in the same
   range, EOS never sampled): transformers' eager attention with its ``DynamicLayer`` cache (the
   server before) vs SDPA, vs SDPA with the growing cache (``engine._growing_layer_class``, now).
4. **The rollout client's concurrency** (``rollout.max_concurrency``): 128 requests (16 prompts x
   8 samples, lengths as above) through ``RolloutClient`` to 2 local servers, 64 in flight (the
   old default) vs 512 (the new one).

Prints markdown tables (docs/performance.md, "CPU kernels of the RL step").
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_packing import make_batch  # noqa: E402
from bench.spawn import run_on_ranks  # noqa: E402
from megatron_gspo import parallel  # noqa: E402
from megatron_gspo.config import config_from_dict  # noqa: E402
from megatron_gspo.train.rl_trainer import RLTrainer  # noqa: E402
from pipeline.generation.client import RolloutClient, SamplingParams  # noqa: E402
from pipeline.local.engine import EngineRequest, LocalEngine  # noqa: E402
from pipeline.local.protocol import Sampling  # noqa: E402
from pipeline.servers.cluster import LocalRolloutCluster  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
             head_dim=32, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=128)


def lengths_of(args) -> list[int]:
    rng = random.Random(args.seed)
    return [rng.randint(args.min_len, args.max_len) for _ in range(args.seqs)]


def best(fn, repeats: int, clock=time.process_time) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


# ------------------------------------------------------------------------------------------------
# 1. core attention


def attention_rows(args) -> list[tuple[str, float]]:
    from megatron_gspo.model.attention import causal_attention  # imports megatron.core

    lengths = lengths_of(args)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    gen = torch.Generator().manual_seed(0)
    total = int(cu[-1])
    q = torch.randn(total, 4, 32, generator=gen, requires_grad=True)
    k = torch.randn(total, 2, 32, generator=gen, requires_grad=True)
    v = torch.randn(total, 2, 32, generator=gen, requires_grad=True)
    grad = torch.randn(total, 4, 32, generator=gen)

    def step(kernel):
        def run():
            out = causal_attention(q, k, v, cu, kernel=kernel)
            torch.autograd.grad(out, (q, k, v), grad)
        return run

    return [(kernel, best(step(kernel), args.repeats)) for kernel in ("blockwise", "sdpa")]


# ------------------------------------------------------------------------------------------------
# 2. the training step


def _train_worker(rank, world, cfg_dict, batch, repeats, kernel):
    import megatron_gspo.model.attention as attention  # imports megatron.core

    torch.set_num_threads(1)
    if kernel != "auto":  # PackedCoreAttention calls the module's causal_attention
        attention.causal_attention = functools.partial(attention.causal_attention, kernel=kernel)
    cfg = config_from_dict(cfg_dict)
    pg = parallel.initialize(cfg.parallel, seed=cfg.run.seed)
    trainer = RLTrainer(cfg, pg)
    step = iter(range(10**6))
    seconds = best(lambda: trainer.train_rollout(batch, next(step)), repeats)
    parallel.destroy_model_parallel()
    return seconds


def train_rows(args) -> list[tuple[str, float]]:
    lengths = lengths_of(args)
    batch = make_batch(lengths, 256, args.seed)
    cfg = {"model": {**MODEL, "vocab_size": 256, "max_position_embeddings": 4096},
           "gspo": {"group_size": 8, "updates_per_rollout": 2, "routing_metrics": False},
           "optim": {"lr": 1e-4},
           "run": {"global_batch_size": len(lengths), "micro_batch_size": min(16, len(lengths) // 2),
                   "seq_length": max(lengths), "num_steps": 100,
                   "max_tokens_per_micro_batch": 4096}}
    return [(name, run_on_ranks(1, _train_worker, (cfg, batch, args.repeats, kernel),
                                timeout_s=3000)[0])
            for name, kernel in (("blockwise attention", "blockwise"), ("SDPA (default)", "auto"))]


# ------------------------------------------------------------------------------------------------
# 3. server decoding, 4. client concurrency


def make_model(directory: Path) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=8192, hidden_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         moe_intermediate_size=128, intermediate_size=128, num_experts=16,
                         num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=8191,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(directory)
    return directory


def _requests(args, rows: int):
    rng = random.Random(args.seed + 1)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(rows)]
    prompts = [[rng.randint(2, 8000) for _ in range(rng.randint(20, 50))] for _ in range(rows)]
    return prompts, lengths


def decode_rows(args, model_dir: Path) -> list[tuple[str, float, int]]:
    from transformers import DynamicCache

    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    engine = LocalEngine(str(model_dir), random_seed=0)
    prompts, lengths = _requests(args, 64)
    growing = LocalEngine.__dict__["_cache_from"]  # the staticmethod object itself
    plain = staticmethod(lambda kv: DynamicCache(ddp_cache_data=kv))

    def run(attn: str, cache) -> None:
        engine.model.config._attn_implementation = attn  # read at every forward
        LocalEngine._cache_from = cache
        reqs = []
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            r = EngineRequest(str(i), p, Sampling(max_new_tokens=n, ignore_eos=True),
                              return_logprob=True)
            r.generator = torch.Generator().manual_seed(i)
            reqs.append(r)
        engine._prefill(reqs)
        while engine._running:
            engine._decode_step()

    rows = []
    try:
        for name, attn, cache in (("eager attention, DynamicLayer cache (before)", "eager", plain),
                                  ("SDPA, DynamicLayer cache", "sdpa", plain),
                                  ("SDPA, growing cache (now)", "sdpa", growing)):
            rows.append((name, best(lambda: run(attn, cache), args.repeats), sum(lengths)))
    finally:
        LocalEngine._cache_from = growing
    return rows


def concurrency_rows(args, model_dir: Path) -> list[tuple[str, float, int]]:
    prompts, lengths = _requests(args, 16)
    requests = [(f"p{p}-s{s}", prompts[p],
                 SamplingParams(max_new_tokens=random.Random(p * 8 + s).randint(args.min_len,
                                                                                args.max_len),
                                sampling_seed=p * 8 + s))
                for p in range(16) for s in range(8)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_kernels_") as tmp:
        with LocalRolloutCluster(model_dir, 2, router=False, log_dir=tmp) as cluster:
            for concurrency in (64, 512):
                client = RolloutClient(server_urls=cluster.server_urls,
                                       max_concurrency=concurrency, request_timeout_s=600)
                out: list = []
                seconds = best(lambda: out.append(client.generate_sync(requests)), args.repeats,
                               clock=time.perf_counter)
                tokens = sum(len(r.output_ids) for r in out[-1])
                rows.append((f"max_concurrency {concurrency}"
                             + (" (old default)" if concurrency == 64 else " (default)"),
                             seconds, tokens))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=60)
    ap.add_argument("--max-len", type=int, default=290)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    tokens = sum(lengths_of(args))
    print(f"{args.seqs} sequences of {args.min_len}-{args.max_len} tokens ({tokens} tokens); best "
          f"of {args.repeats}; torch {torch.__version__}, {os.cpu_count()} cores, 1 thread\n")

    def table(title, unit, rows, per=None):
        print(f"| {title} | {unit} | tokens / s | vs first row |\n|---|---:|---:|---:|")
        base = rows[0][1]
        for row in rows:
            n = row[2] if len(row) > 2 else per
            print(f"| {row[0]} | {row[1]:.3f} | {n / row[1]:.0f} | {base / row[1]:.2f}x |")
        print(flush=True)

    table("core attention, forward + backward", "CPU s", attention_rows(args), tokens)
    table("train_rollout (recompute + 2 updates)", "CPU s", train_rows(args), tokens)
    with tempfile.TemporaryDirectory(prefix="bench_kernels_model_") as tmp:
        model_dir = make_model(Path(tmp) / "model")
        table("server decoding, 64 rows", "CPU s", decode_rows(args, model_dir))
        table("rollout of 128 requests on 2 servers", "wall s", concurrency_rows(args, model_dir))
    print(f"load average at the end {os.getloadavg()[0]:.1f}; total {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
