"""Weight sync throughput on the CPU: every transport against a memory copy of the same bytes.

Run (about 4 minutes on the 2-core CPU machine at load 3; results go into docs/performance.md by
hand):

    .venv/bin/python bench/bench_weight_sync.py
    .venv/bin/python bench/bench_weight_sync.py --sizes small --worlds 1 --repeats 2   # quick

For each model size (random Qwen3-MoE, fp32: ``small`` ~70 MB, ``large`` ~1 GB) one local rollout
server is started (``megatron-gspo serve --allow-pickled-tensors``, one torch thread); for each
training world (1 rank; 2 ranks as PP2 and as EP2, spawned gloo ranks with one torch thread each)
the real Megatron policy is built and, in the same run:

* **memcpy**: rank 0 copies a buffer of the model's bytes into another (``torch`` ``copy_``, one
  thread), right before each push (so both see the same machine load): one memory copy of the
  same bytes, the reference of that push's ratio;
* **gloo_wire** (world 2 only): the same bytes broadcast from rank 0 to rank 1 over gloo in
  bucket-sized pieces, nothing else: what the ``distributed`` transport's wire alone costs here
  (loopback TCP: a copy into the kernel and one out of it);
* **disk** (shards in ``/dev/shm``), **distributed**, **tensor**: ``WeightPusher.push(trainer buckets)`` with that
  transport, checksums verified (the default): the whole sync, pause to continue, as the RL loop
  runs it (after one warm-up push that builds the groups and buffers);
* **delta**: bf16 on the wire, ``distributed``, after a full push: 1% of the weights perturbed
  (a small-lr step changes few bf16 values), then the delta push; its reference is a memory copy
  of the bf16 model bytes.

Times and ratios (memcpy seconds / push seconds, pairwise) are medians of ``--repeats`` pushes.
Then, per push, where the time went: the trainer's wait for the gather and time sending, the
servers' own ``timings`` (receive, load into the model + checksum; summed over buckets).
The last line is ``weight sync vs memcpy: disk X.XXx, distributed Y.YYx, tensor Z.ZZx``: the
median ratios over the world-2 runs (PP2 and EP2) of the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.spawn import run_on_ranks  # noqa: E402
from megatron_gspo import parallel  # noqa: E402
from megatron_gspo.config import ParallelConfig  # noqa: E402
from megatron_gspo.hf.gather import HFGather  # noqa: E402
from megatron_gspo.hf.hf_config import model_config_from_hf  # noqa: E402
from megatron_gspo.model import gpt as policy  # noqa: E402
from pipeline.servers.cluster import LocalRolloutCluster  # noqa: E402
from pipeline.weights.push import WeightPusher  # noqa: E402

SIZES = {  # name -> (hidden, layers, experts, moe intermediate, vocab)
    "small": (256, 4, 16, 256, 8192),
    "large": (512, 8, 36, 512, 16384),
}
WORLDS = {"1": (1, {}), "PP2": (2, {"pipeline": 2}), "EP2": (2, {"expert": 2})}
TRANSPORTS = ("disk", "distributed", "tensor")


def make_model(directory: Path, size: str) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, layers, experts, inter, vocab = SIZES[size]
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                         moe_intermediate_size=inter, intermediate_size=inter,
                         num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
                         max_position_embeddings=1024, tie_word_embeddings=False,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to_empty(device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(directory)
    return directory


def _median_copy(nbytes: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A process's resident memory (or its peak, ``VmHWM``) in MB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _dir_mb(path: str) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e6


def bench_worker(rank: int, world: int, section: dict, hf_dir: str, url: str, shared: str,
                 repeats: int, bucket_bytes: int):
    par = ParallelConfig(**section)
    pg = parallel.initialize(par)
    control = dist.new_group(backend="gloo")
    model_cfg = model_config_from_hf(hf_dir)
    gpt = policy.build_model(model_cfg, par, pg)
    policy.init_weights(gpt, model_cfg, pg, seed=1)
    gather = HFGather(model_cfg, bucket_bytes=bucket_bytes)
    total = gather.buckets(gpt, pg).total_bytes
    rss_start = _rss_mb(os.getpid())
    copies = {"memcpy": [], "memcpy_bf16": []}

    def memcpy(key: str, nbytes: int) -> float:
        """One memory copy of ``nbytes`` on rank 0, right before a push (the same load)."""
        dist.barrier(control)
        seconds = _median_copy(nbytes, 1) if rank == 0 else 0.0
        copies[key].append(seconds)
        dist.barrier(control)
        return seconds

    rows = {}
    if world == 2:  # the wire alone: gloo broadcasts of the same bytes between the two ranks
        buf = torch.zeros(min(bucket_bytes, total), dtype=torch.uint8)
        chunks = [min(buf.numel(), total - off) for off in range(0, total, buf.numel())]
        times, ratios = [], []
        for _ in range(repeats):
            copy_s = memcpy("memcpy", total)
            dist.barrier(control)
            t0 = time.perf_counter()
            for n in chunks:
                dist.broadcast(buf[:n], src=0, group=control)
            dist.barrier(control)
            times.append(time.perf_counter() - t0)
            ratios.append(copy_s / times[-1])
        rows["gloo_wire"] = {"seconds": times, "ratios": ratios, "bytes": total,
                             "wire_bytes": total}
    for transport in TRANSPORTS:
        pusher = WeightPusher([url], transport=transport, shared_dir=shared, group=control)
        pusher.push(gather.buckets(gpt, pg), f"{transport}-warm")
        times, ratios, stats, phases = [], [], None, []
        for r in range(repeats):
            copy_s = memcpy("memcpy", total)
            stats = pusher.push(gather.buckets(gpt, pg), f"{transport}-{r}")
            times.append(stats.seconds_total)
            ratios.append(copy_s / stats.seconds_total)
            phases.append({"gather_wait_s": stats.seconds_gather, "send_s": stats.seconds_send,
                           **stats.phases})
        pusher.close()
        rows[transport] = {"seconds": times, "ratios": ratios, "bytes": stats.bytes,
                           "wire_bytes": stats.wire_bytes, "buckets": stats.num_buckets,
                           "sources": len(gather.buckets(gpt, pg).sources), "phases": phases}
    # delta: bf16 on the wire
    gather16 = HFGather(model_cfg, bucket_bytes=bucket_bytes, dtype=torch.bfloat16)
    pusher = WeightPusher([url], transport="distributed", delta=True, full_every=10**6,
                          group=control)
    pusher.push(gather16.buckets(gpt, pg), "delta-full")
    gen = torch.Generator().manual_seed(rank)
    times, ratios, stats = [], [], None
    for r in range(repeats):
        with torch.no_grad():
            for p in gpt.parameters():
                pick = torch.rand(p.shape, generator=gen) < 0.01
                p.add_(pick * 0.1 * p.abs().clamp_min(1e-3))
        copy_s = memcpy("memcpy_bf16", total // 2)
        stats = pusher.push(gather16.buckets(gpt, pg), f"delta-{r}")
        assert stats.delta, "the delta push was a full one"
        times.append(stats.seconds_total)
        ratios.append(copy_s / stats.seconds_total)
    pusher.close()
    rows["delta"] = {"seconds": times, "ratios": ratios, "bytes": stats.bytes,
                     "wire_bytes": stats.wire_bytes}
    for key, nbytes in (("memcpy", total), ("memcpy_bf16", total // 2)):
        rows[key] = {"seconds": copies[key], "ratios": [1.0] * len(copies[key]), "bytes": nbytes}
    rows["load_avg"] = list(os.getloadavg())
    rows["trainer_rss_mb"] = {"start": rss_start, "end": _rss_mb(os.getpid()),
                              "peak": _rss_mb(os.getpid(), "VmHWM")}
    parallel.destroy_model_parallel()
    return rows if rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--worlds", default="1,PP2,EP2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()

    results = []
    # The disk transport's "shared filesystem": tmpfs where there is one (on one machine the
    # servers read the page cache either way; tmpfs keeps writeback out of the timings).
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="bench_sync_") as tmp, \
            tempfile.TemporaryDirectory(prefix="bench_sync_shared_", dir=shm) as shared:
        tmp = Path(tmp)
        for size in args.sizes.split(","):
            model_dir = make_model(tmp / size, size)
            with LocalRolloutCluster(model_dir, 1, router=False, log_dir=tmp / "logs",
                                     server_args=["--allow-pickled-tensors",
                                                  "--weight-roots", shared],
                                     health_timeout_s=600) as cluster:
                for world_name in args.worlds.split(","):
                    world, section = WORLDS[world_name]
                    t0 = time.perf_counter()
                    server_pid = cluster._procs["server0"].pid
                    server_before = _rss_mb(server_pid)
                    rows = run_on_ranks(world, bench_worker,
                                        (section, str(model_dir), cluster.server_urls[0],
                                         shared, args.repeats,
                                         args.bucket_mib << 20), timeout_s=1800)[0]
                    rows["server_rss_mb"] = {"before": server_before,
                                             "after": _rss_mb(server_pid),
                                             "peak": _rss_mb(server_pid, "VmHWM")}
                    rows["shared_dir_mb"] = _dir_mb(shared)  # what the disk transport left
                    results.append({"size": size, "world": world_name, "rows": rows,
                                    "wall_s": time.perf_counter() - t0})
                    print(f"# {size} world {world_name}: {time.perf_counter() - t0:.0f} s",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))

    print("| size | world | what | MB | wire MB | seconds (median) | GB/s | vs memcpy |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    ratios: dict[str, list[float]] = {t: [] for t in TRANSPORTS}
    largest = args.sizes.split(",")[-1]
    for res in results:
        rows = res["rows"]
        for what in ("memcpy", "gloo_wire", *TRANSPORTS, "memcpy_bf16", "delta"):
            if what not in rows:
                continue
            row = rows[what]
            sec = statistics.median(row["seconds"])
            wire = row.get("wire_bytes", row["bytes"])
            print(f"| {res['size']} | {res['world']} | {what} | {row['bytes'] / 1e6:.1f} | "
                  f"{wire / 1e6:.1f} | {sec:.3f} | {row['bytes'] / sec / 1e9:.2f} | "
                  f"{statistics.median(row['ratios']):.2f}x |")
            if what in TRANSPORTS and res["size"] == largest and res["world"] != "1":
                ratios[what] += row["ratios"]
    print()
    print("Where the time goes (median push; seconds; server_* summed over buckets, the slowest "
          "server; load average at the end of each world's run):")
    for res in results:
        for what in TRANSPORTS:
            row = res["rows"][what]
            mid = sorted(range(len(row["seconds"])), key=row["seconds"].__getitem__)[
                len(row["seconds"]) // 2]
            ph = row["phases"][mid]
            print(f"  {res['size']} {res['world']} {what}: total {row['seconds'][mid]:.3f} | "
                  + ", ".join(f"{k} {v:.3f}" for k, v in sorted(ph.items()))
                  + f" | load {res['rows']['load_avg'][0]:.1f}")
    print()
    print("Memory (MB; RSS from /proc: the server before / after the world's pushes and its peak "
          "since start; trainer rank 0 after building the model / at the end / peak; the disk "
          "transport's files left in the shared directory):")
    for res in results:
        srv, trn = res["rows"]["server_rss_mb"], res["rows"]["trainer_rss_mb"]
        print(f"  {res['size']} {res['world']}: server {srv['before']:.0f} / {srv['after']:.0f} "
              f"/ peak {srv['peak']:.0f}; trainer {trn['start']:.0f} / {trn['end']:.0f} / peak "
              f"{trn['peak']:.0f}; shared dir {res['rows']['shared_dir_mb']:.0f}")
    if all(ratios.values()):
        print("weight sync vs memcpy: " + ", ".join(
            f"{t} {statistics.median(ratios[t]):.2f}x" for t in TRANSPORTS))
    else:
        print("weight sync vs memcpy: (no world-2 run of the largest size)")


if __name__ == "__main__":
    main()
