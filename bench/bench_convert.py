"""Benchmark: HF <-> Megatron conversion throughput (against ``cp``) and peak memory.

    .venv/bin/python bench/bench_convert.py                       # 3- and 6-layer models
    .venv/bin/python bench/bench_convert.py --layers 3 --workdir /tmp/bench_convert

For each size, a synthetic Qwen3-MoE checkpoint with Qwen3-30B-A3B's layer shapes (hidden 2048,
32 heads / 4 KV groups of 128, 128 experts of 768, vocabulary 151936, untied, bf16) but fewer
layers is written as Hugging Face safetensors shards (~1.25 GB per layer + 1.24 GB of embeddings).
Then, repeated ``--repeats`` times (interleaved, median reported), each conversion in a fresh
process (``python -m launch.convert``):

1. ``cp -r`` of the HF directory (the same bytes), timed;
2. ``convert hf-to-mcore --tp 4 --ep 8`` (one writer thread), timed, its peak RSS (VmHWM);
3. ``cp -r`` of the Megatron directory, then ``convert mcore-to-hf`` of it, timed, peak RSS;

then a spot check that exported tensors equal the synthetic ones, one more hf-to-mcore with
fsync, and everything is deleted. Throughput ratio = cp seconds / conversion seconds for the same
bytes (target >= 0.5), per repetition (cp and the conversion run back to back). Before every
timed step the source is read once, untimed (page cache warm for cp and the converter alike),
and ``sync`` runs. "process" times include interpreter start-up and imports (2-3 s here,
independent of the model size); "convert only" is the time the converter itself reports. cp and
the converter alike leave the written pages for the kernel to flush (``--no-fsync``); the
fsync'd conversion is shown separately.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_gspo.hf.safetensors_io import (HFCheckpoint, ShardWriter, plan_shards,  # noqa: E402
                                          shard_file_names, write_index)

QWEN3_30B_SHAPES = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                        head_dim=128, num_experts=128, num_experts_per_tok=8,
                        moe_intermediate_size=768, vocab_size=151936)


def hf_config(num_layers: int) -> dict:
    c = QWEN3_30B_SHAPES
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_hidden_layers": num_layers, "hidden_size": c["hidden_size"],
            "num_attention_heads": c["num_attention_heads"],
            "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
            "num_experts": c["num_experts"], "num_experts_per_tok": c["num_experts_per_tok"],
            "moe_intermediate_size": c["moe_intermediate_size"], "intermediate_size": 6144,
            "vocab_size": c["vocab_size"], "norm_topk_prob": True, "tie_word_embeddings": False,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
            "hidden_act": "silu", "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": False, "attention_bias": False, "torch_dtype": "bfloat16"}


def synthetic_value(name: str, shape: tuple, pool: torch.Tensor) -> torch.Tensor:
    """A deterministic bf16 tensor per name: a window of a random pool (cheap to make)."""
    n = math.prod(shape)
    start = zlib.crc32(name.encode()) % (pool.numel() - n) if pool.numel() > n else 0
    if n <= pool.numel():
        return pool[start:start + n].view(shape)
    return pool.repeat(math.ceil(n / pool.numel()))[:n].view(shape)


def write_synthetic(directory: Path, num_layers: int, shard_bytes: int = 2 * 10**9) -> int:
    from megatron_gspo.hf.mapping import hf_param_shapes
    from megatron_gspo.hf.hf_config import model_config_from_hf

    directory.mkdir(parents=True)
    config = hf_config(num_layers)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    model = model_config_from_hf(config)
    entries = [(name, shape, torch.bfloat16) for name, shape in hf_param_shapes(model).items()]
    shards = plan_shards(entries, shard_bytes)
    pool = torch.randn(400_000_000 // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    weight_map, total = {}, 0
    for file, shard in zip(shard_file_names(len(shards)), shards):
        writer = ShardWriter(directory / file, shard)
        for name, shape, _ in shard:
            writer.write(name, synthetic_value(name, shape, pool))
            weight_map[name] = file
            total += math.prod(shape) * 2
        writer.close(fsync=False)
    write_index(directory, weight_map, total)
    return total


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def warm(path: Path) -> None:
    """Read every file of ``path`` (untimed), so that the timed step finds it in the page cache
    whatever the other jobs on the machine evicted: cp and the converter start alike."""
    buffer = bytearray(64 * 2**20)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        with open(file, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def timed_cp(src: Path, dst: Path) -> float:
    warm(src)
    os.sync()  # every timed step starts without dirty pages of the previous one
    start = time.perf_counter()
    subprocess.run(["cp", "-r", "--reflink=never", str(src), str(dst)], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(dst)
    return seconds


# Runs ``launch.convert`` and, at exit, prints the process's own peak RSS (VmHWM of its address
# space; ru_maxrss from wait4 would include the forked parent's pages from before exec).
_WRAPPER = ("import atexit, runpy, sys\n"
            "def _peak():\n"
            "    status = open('/proc/self/status').read()\n"
            "    print('VmHWM_kB', status.split('VmHWM:')[1].split()[0], file=sys.stderr)\n"
            "atexit.register(_peak)\n"
            "sys.argv = ['launch.convert', *sys.argv[1:]]\n"
            "runpy.run_module('launch.convert', run_name='__main__')\n")


def run_convert(args: list[str], source: Path, out_dir: Path) -> dict:
    """Run ``python -m launch.convert ARGS`` in a fresh process: wall seconds (process start and
    imports included), the seconds the converter reports, peak RSS in GiB."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    warm(source)
    os.sync()
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *args, "--no-progress"], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"convert {args} failed:\n{proc.stdout}\n{proc.stderr}")
    reported = float(proc.stdout.strip().split(" in ")[-1].split(" s")[0])
    peak_kb = int(proc.stderr.split("VmHWM_kB")[-1].split()[0])
    return {"wall_s": wall, "convert_s": reported, "peak_rss_gib": peak_kb / 2**20}


def spot_check(src: Path, exported: Path, num_layers: int) -> None:
    with HFCheckpoint(src) as a, HFCheckpoint(exported) as b:
        names = ["model.embed_tokens.weight", "lm_head.weight",
                 f"model.layers.{num_layers - 1}.self_attn.q_proj.weight",
                 f"model.layers.{num_layers - 1}.mlp.experts.127.up_proj.weight",
                 "model.layers.0.mlp.experts.5.down_proj.weight"]
        for name in names:
            if not torch.equal(a.read(name), b.read(name)):
                raise AssertionError(f"{name}: exported tensor differs from the source")


def _median_run(results: list[dict]) -> dict:
    """The run with the median conversion time (keeps wall, converter time and RSS together)."""
    return sorted(results, key=lambda r: r["convert_s"])[len(results) // 2]


def bench_size(workdir: Path, num_layers: int, repeats: int) -> dict:
    src, mcore, export = workdir / "hf", workdir / "mcore", workdir / "export"
    for path in (src, mcore, export):
        if path.exists():
            shutil.rmtree(path)
    to_mcore_args = ["hf-to-mcore", "--hf", str(src), "--out", str(mcore), "--tp", "4", "--ep", "8"]
    to_hf_args = ["mcore-to-hf", "--mcore", str(mcore), "--out", str(export)]
    try:
        payload = write_synthetic(src, num_layers)
        disk = du(src)
        cp_hf, cp_mcore, to_mcore, to_hf = [], [], [], []
        for _ in range(repeats):  # interleaved, so both sides see the same machine load
            cp_hf.append(timed_cp(src, workdir / "hf_copy"))
            to_mcore.append(run_convert(to_mcore_args + ["--no-fsync"], src, mcore))
            cp_mcore.append(timed_cp(mcore, workdir / "mcore_copy"))
            to_hf.append(run_convert(to_hf_args + ["--no-fsync"], mcore, export))
        spot_check(src, export, num_layers)
        synced = run_convert(to_mcore_args, src, mcore)
        return {"layers": num_layers, "hf_bytes": disk, "payload_bytes": payload,
                "load_average_1min": os.getloadavg()[0], "cpus": os.cpu_count(),
                "mcore_bytes": du(mcore), "cp_hf_s": sorted(cp_hf)[repeats // 2],
                "cp_mcore_s": sorted(cp_mcore)[repeats // 2], "hf_to_mcore": _median_run(to_mcore),
                "mcore_to_hf": _median_run(to_hf), "hf_to_mcore_fsync": synced,
                "all_runs": {"cp_hf_s": cp_hf, "cp_mcore_s": cp_mcore, "hf_to_mcore": to_mcore,
                             "mcore_to_hf": to_hf}}
    finally:
        for path in (src, mcore, export):
            if path.exists():
                shutil.rmtree(path)


def _pair_ratios(cp_runs: list[float], conv_runs: list[dict], key: str) -> list[float]:
    """cp / conversion per repetition: each pair ran back to back, under the same load."""
    return sorted(c / r[key] for c, r in zip(cp_runs, conv_runs))


def report(rows: list[dict]) -> str:
    lines = ["| model (layers) | HF size | direction | cp (median) | convert, process (median) | "
             "ratio, process | convert only (median) | ratio, convert only | peak RSS |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        size = f"{r['hf_bytes'] / 1e9:.2f} GB"
        runs = r["all_runs"]
        for label, key, cp_key in (("hf-to-mcore", "hf_to_mcore", "cp_hf_s"),
                                   ("mcore-to-hf", "mcore_to_hf", "cp_mcore_s")):
            conv = runs[key]
            walls = sorted(x["wall_s"] for x in conv)
            only = sorted(x["convert_s"] for x in conv)
            cps = sorted(runs[cp_key])
            mid = len(cps) // 2
            pw, po = _pair_ratios(runs[cp_key], conv, "wall_s"), _pair_ratios(runs[cp_key], conv, "convert_s")
            rss = max(x["peak_rss_gib"] for x in conv)
            lines.append(f"| {r['layers']} | {size} | {label} | {cps[mid]:.2f} s | {walls[mid]:.2f} s | "
                         f"{pw[mid]:.2f} ({pw[0]:.2f}-{pw[-1]:.2f}) | {only[mid]:.2f} s | "
                         f"{po[mid]:.2f} ({po[0]:.2f}-{po[-1]:.2f}) | {rss:.2f} GiB |")
        m = r["hf_to_mcore_fsync"]
        lines.append(f"| {r['layers']} | {size} | hf-to-mcore with fsync (once) | - | {m['wall_s']:.2f} s | - | "
                     f"{m['convert_s']:.2f} s | - | {m['peak_rss_gib']:.2f} GiB |")
    return "\n".join(lines) + ("\n\nratio = cp seconds / conversion seconds of the same "
                                "repetition (run back to back); median (min-max) over repetitions.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="3,6",
                        help="comma-separated layer counts, one synthetic model each (default 3,6)")
    parser.add_argument("--workdir", default="/tmp/bench_convert", type=Path)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs of each step per size; medians are reported (default 5)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        rows.append(bench_size(args.workdir, layers, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    print(report(rows))


if __name__ == "__main__":
    main()
