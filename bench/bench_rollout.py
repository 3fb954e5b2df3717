"""Local rollout server throughput, and weight-sync throughput, on the CPU.

Run (about 2 minutes on the 2-core CPU machine):

    .venv/bin/python bench/bench_rollout.py
    .venv/bin/python bench/bench_rollout.py --batch 32 --new-tokens 128 --threads 2

1. **Decoding**: one ``megatron-gspo serve`` subprocess (``--cpu-threads T``) answers ONE batched
   ``/generate`` of B prompts x N new tokens (``ignore_eos``, sampled at T=1); tokens/s = B*N / wall
   time of the HTTP call (prefill included). Reference in the same run, same model, same batch,
   same thread count: transformers' ``model.generate(do_sample=True, min_new_tokens=N,
   max_new_tokens=N)`` on left-padded prompts with its default KV cache, in this process.
   Also: the same B requests sent as B concurrent single requests through ``RolloutClient``
   (what the RL loop does), and batch 1. Best of ``--repeats`` runs each.
2. **Weight sync**: the real Megatron policy (world 1, gloo) built for the same model, synced to
   the server with each transport (``sync_weights``); GB/s = weight bytes / wall time of the whole
   sync (pause, gather, send, load, flush, continue). Reference: ``torch`` copy of the same
   tensors into preallocated buffers (a plain memory copy of the same bytes).

Results go to stdout as a markdown table (append them to docs/performance.md by hand).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_model(directory: Path, args) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=args.hidden // 8,
                         moe_intermediate_size=args.moe_inter, intermediate_size=args.moe_inter,
                         num_experts=args.experts, num_experts_per_tok=2, norm_topk_prob=True,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() > 1 else
                    1 + 0.1 * torch.randn(p.shape))
    model.save_pretrained(directory)
    return directory


def prompts(args) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.batch,), generator=gen)
    return [torch.randint(2, args.vocab, (int(n),), generator=gen).tolist() for n in lengths]


_HF_MODELS: dict = {}


@torch.no_grad()
def hf_generate(model_dir: Path, batch: list[list[int]], new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM

    model = _HF_MODELS.get(model_dir) or AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    _HF_MODELS[model_dir] = model
    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kwargs = dict(attention_mask=mask, do_sample=True, min_new_tokens=new_tokens,
                  max_new_tokens=new_tokens, pad_token_id=0, top_k=0, top_p=1.0, temperature=1.0)
    model.generate(ids[:1], **{**kwargs, "attention_mask": mask[:1], "max_new_tokens": 2,
                                "min_new_tokens": 2})  # warm-up
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens
    return seconds


def server_generate(url: str, batch: list[list[int]], new_tokens: int) -> float:
    from pipeline.generation.client import http_json

    body = {"input_ids": batch, "sampling_params": {"max_new_tokens": new_tokens,
                                                    "ignore_eos": True}}
    http_json("POST", url + "/generate", {"input_ids": batch[0], "sampling_params": {
        "max_new_tokens": 2}}, timeout_s=600)  # warm-up
    t0 = time.perf_counter()
    status, out = http_json("POST", url + "/generate", body, timeout_s=600)
    seconds = time.perf_counter() - t0
    assert status == 200 and all(len(o["output_ids"]) == new_tokens for o in out), out
    return seconds


def client_generate(url: str, batch: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from pipeline.generation.client import RolloutClient, SamplingParams

    client = RolloutClient(server_urls=[url], request_timeout_s=600)
    sp = SamplingParams(max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    results = client.generate_sync([(f"b{i}", p, sp) for i, p in enumerate(batch)])
    return time.perf_counter() - t0, sum(len(r.output_ids) for r in results)


def sync_bench(model_dir: Path, url: str, shared: Path, args) -> list[dict]:
    import torch.distributed as dist

    from megatron_gspo.model import gpt as policy

    from megatron_gspo.hf.hf_config import model_config_from_hf
    from megatron_gspo import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.hf.gather import HFGather
    from pipeline.weights.push import WeightPusher
    from pipeline.servers.cluster import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    rows = []
    try:
        par = ParallelConfig()
        pg = parallel.initialize(par)
        model_cfg = model_config_from_hf(str(model_dir))
        gpt = policy.build_model(model_cfg, par, pg)
        policy.init_weights(gpt, model_cfg, pg, seed=5)
        tensors = [p.detach() for p in gpt.parameters()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        buffers = [torch.empty_like(t) for t in tensors]
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for b, t in zip(buffers, tensors):
                b.copy_(t)
            times.append(time.perf_counter() - t0)
        copy_s = min(times)
        rows.append({"what": "memory copy (torch copy_ of the same tensors)", "seconds": copy_s,
                     "bytes": nbytes})
        for k, transport in enumerate(args.transports):
            best = None
            gather = HFGather(model_cfg, bucket_bytes=args.bucket_mib * 2**20)
            pusher = WeightPusher([url], transport=transport, shared_dir=shared)
            for r in range(args.sync_repeats):
                stats = pusher.push(gather.buckets(gpt, pg), f"{k}.{r}")
                if best is None or stats.seconds_total < best.seconds_total:
                    best = stats
            pusher.close()
            rows.append({"what": f"sync_weights transport={transport}", "seconds":
                         best.seconds_total, "bytes": best.bytes, "stats": best})
        parallel.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    return rows


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The sizes :func:`make_model` reads (also bench_prefix_cache.py's)."""
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="decoding: best of this many interleaved runs")
    ap.add_argument("--transports", nargs="+", default=["disk", "tensor", "distributed"])
    ap.add_argument("--sync-repeats", type=int, default=2)
    ap.add_argument("--bucket-mib", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pipeline.servers.cluster import LocalRolloutCluster

    with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
        tmp = Path(tmp)
        model_dir = make_model(tmp / "model", args)
        batch = prompts(args)
        with LocalRolloutCluster(model_dir, 1, router=False, log_dir=tmp / "logs",
                                 cpu_threads=args.threads) as cluster:
            url = cluster.server_urls[0]
            # Interleaved repeats (the machine is shared: both sides see the same load), best of.
            runs: dict[str, list] = {k: [] for k in ("hf", "hf1", "srv", "srv1", "cli")}
            for _ in range(args.repeats):
                runs["hf"].append(hf_generate(model_dir, batch, args.new_tokens))
                runs["srv"].append(server_generate(url, batch, args.new_tokens))
                runs["cli"].append(client_generate(url, batch, args.new_tokens))
                runs["hf1"].append(hf_generate(model_dir, batch[:1], args.new_tokens))
                runs["srv1"].append(server_generate(url, batch[:1], args.new_tokens))
            hf_s, hf1_s, srv_s, srv1_s = (min(runs[k]) for k in ("hf", "hf1", "srv", "srv1"))
            cli_s, cli_tokens = min(runs["cli"])
            sync_rows = sync_bench(model_dir, url, tmp / "shared", args)

    tok = args.batch * args.new_tokens
    print(f"\n### Local rollout server ({datetime.date.today()}, {platform.processor() or 'cpu'}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f})\n")
    print(f"Model: Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts "
          f"(top-2, intermediate {args.moe_inter}), vocab {args.vocab}, fp32; prompts "
          f"{args.prompt_len // 2}-{args.prompt_len} tokens.\n")
    print("| decoding | batch | new tokens | seconds | tokens/s | vs transformers |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| transformers `generate` | {args.batch} | {args.new_tokens} | {hf_s:.2f} | "
          f"{tok / hf_s:.0f} | 1.00x |")
    print(f"| local server, one batched /generate | {args.batch} | {args.new_tokens} | "
          f"{srv_s:.2f} | {tok / srv_s:.0f} | {hf_s / srv_s:.2f}x |")
    print(f"| local server, {args.batch} concurrent requests (RolloutClient) | {args.batch} | "
          f"{args.new_tokens} (EOS allowed: {cli_tokens} tokens) | {cli_s:.2f} | "
          f"{cli_tokens / cli_s:.0f} | - |")
    print(f"| transformers `generate` | 1 | {args.new_tokens} | {hf1_s:.2f} | "
          f"{args.new_tokens / hf1_s:.0f} | 1.00x |")
    print(f"| local server | 1 | {args.new_tokens} | {srv1_s:.2f} | "
          f"{args.new_tokens / srv1_s:.0f} | {hf1_s / srv1_s:.2f}x |")
    print("\n| weight sync | MB | seconds | GB/s | vs memory copy |")
    print("| --- | ---: | ---: | ---: | ---: |")
    copy_rate = sync_rows[0]["bytes"] / sync_rows[0]["seconds"]
    for row in sync_rows:
        rate = row["bytes"] / row["seconds"]
        print(f"| {row['what']} | {row['bytes'] / 1e6:.1f} | {row['seconds']:.3f} | "
              f"{rate / 1e9:.3f} | {rate / copy_rate:.4f}x |")
    for row in sync_rows[1:]:
        s = row["stats"]
        print(f"\n{row['what']}: {s.num_buckets} buckets, gather {s.seconds_gather:.3f} s, "
              f"send {s.seconds_send:.3f} s, phases "
              + ", ".join(f"{k} {v:.3f}" for k, v in s.phases.items()))


if __name__ == "__main__":
    main()
