"""Synchronous vs asynchronous GSPO on the CPU, with training and rollout on separate cores.

Run (about 6 minutes on the 2-core CPU machine, after the SFT policy):

    .venv/bin/python bench/bench_async.py
    .venv/bin/python bench/bench_async.py --steps 30 --sft-from runs/demo/sft/hf

The demo's task and policy (launch/configs/tiny_cpu.yaml from the SFT policy of
launch/configs/tiny_cpu_sft.yaml, made first unless ``--sft-from`` names one). For each mode the
rollout server and the router run pinned to core 1 (``os.sched_setaffinity``, inherited by the
processes they start) and the trainer's two ranks (EP2) pinned to core 0, in
``rollout.mode: external``, so that generation and training really can overlap on this machine.
Every mode trains the same number of steps on the same number of samples (``run.num_steps`` x
``run.global_batch_size``), from the same seed and policy.

Reported per mode, from the run's own metrics (``metrics.jsonl``):

* time per step (mean over steps 2 .. N-1: the first pays the warm-up, the last the final
  evaluation) and the speedup against ``off`` measured in the same invocation;
* trainer idle fraction (1 - time in ``train_rollout`` / step time) and rollout idle fraction
  (1 - generation time in the step's window / step time), both measured;
* held-out reward at the end (``eval/reward_mean`` +- its standard error over the prompts);
* GSPO clip fraction (mean over steps), staleness (mean version lag per token), and the
  behaviour weights' effective sample size (``mismatch_weight_ess``, the decoupled objective).

Modes: ``off``, ``one_step``, ``full`` (``rollout.max_staleness`` from ``--max-staleness``) with
the decoupled objective, and ``full_bypass``: the same with ``gspo.old_logprobs: rollout`` (the
ratio against the recorded behaviour log-probs), for its clip fraction under staleness.

The last line: ``async vs sync (separate cores): one_step X.XXx, full Y.YYx; held-out reward sync
A.AAA, one_step B.BBB, full C.CCC``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = {"off": ["rollout.async=off"], "one_step": ["rollout.async=one_step"],
         "full": ["rollout.async=full"],
         "full_bypass": ["rollout.async=full", "gspo.old_logprobs=rollout"]}


@contextlib.contextmanager
def pinned(cores: set[int]):
    """This process (and everything it starts meanwhile) on ``cores``."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def cli(*args: str, cores: set[int] | None = None, timeout: float = 1800) -> str:
    pre = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=pre)
    if proc.returncode != 0:
        raise SystemExit(f"megatron-gspo {' '.join(args[:3])} ... exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def sft_policy(work: Path) -> Path:
    out = work / "sft"
    print("SFT policy (launch/configs/tiny_cpu_sft.yaml) ...", flush=True)
    cli("sft", "--config", "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={out}",
        "--set", "run.eval_interval=0", "--set", "run.log_interval=100")
    return out / "hf"


def run_mode(mode: str, policy: Path, work: Path, args, seed: int) -> dict:
    from pipeline.observe.metrics import read_metrics
    from pipeline.servers.cluster import LocalRolloutCluster

    run_dir, weights = work / f"{mode}_s{seed}", work / f"weights_{mode}_s{seed}"
    weights.mkdir(parents=True)
    with pinned({1}):  # the server and the router: core 1
        cluster = LocalRolloutCluster(policy, 1, log_dir=work / f"servers_{mode}_s{seed}",
                                      server_args=["--weight-roots", str(weights)])
        cluster.start()
    try:
        sets = [f"run.output_dir={run_dir}", f"run.init_from={policy}", *MODES[mode],
                f"rollout.max_staleness={args.max_staleness}",
                "rollout.mode=external", f"rollout.router_url={cluster.router_url}",
                f"rollout.weight_sync.dir={weights}", f"run.num_steps={args.steps}",
                f"run.eval_interval={args.steps}", "run.save_interval=0", f"run.seed={seed}"]
        t0 = time.monotonic()
        cli("train", "--config", "launch/configs/tiny_cpu.yaml",
            *[a for s in sets for a in ("--set", s)], cores={0})  # the trainer: core 0
        wall = time.monotonic() - t0
    finally:
        cluster.stop()
    records = read_metrics(run_dir)
    train = [r for r in records if "train/reward_mean" in r]
    steady = train[1:-1] or train

    def mean(key, rows=steady):
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else float("nan")

    final = records[-1]
    return {"mode": mode, "wall_s": wall, "step_s": mean("train/step_s"),
            "trainer_idle": mean("train/trainer_idle_frac"),
            "rollout_idle": mean("train/rollout_idle_frac"),
            "reward": final["eval/reward_mean"], "reward_se": final.get("eval/reward_se", 0.0),
            "reward_start": records[0]["eval/reward_mean"],
            "clip": mean("train/clip_frac", train), "staleness": mean("train/staleness_mean", train),
            "ess": mean("train/mismatch_weight_ess", train),
            "staleness_max": max((r.get("train/staleness_max", 0.0) for r in train), default=0.0),
            "paused": mean("sync/paused_s", train),
            "requeued": sum(r.get("train/requeued", 0.0) for r in train),
            "resumed": sum(r.get("train/resumed", 0.0) for r in train)}


def average(rs: list[dict]) -> dict:
    """One mode's runs (one per seed) -> their means; with several seeds ``reward_se`` is the
    standard error of the mean final held-out reward over the seeds (the run-to-run spread,
    which includes the evaluation's sampling noise)."""
    out = {k: statistics.fmean(r[k] for r in rs) for k in rs[0] if k != "mode"}
    out["staleness_max"] = max(r["staleness_max"] for r in rs)
    out["rewards"] = [r["reward"] for r in rs]
    if len(rs) > 1:
        out["reward_se"] = statistics.stdev(out["rewards"]) / len(rs) ** 0.5
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per mode (default 20)")
    p.add_argument("--seed", type=int, default=1234, help="run.seed of every mode")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per mode, with run.seed --seed, --seed + 1, ...; the table shows the "
                        "means (and the held-out reward's spread over the seeds)")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="rollout.max_staleness of the full modes (default 1)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of "
                   f"{', '.join(MODES)} (off is always run: the baseline)")
    p.add_argument("--sft-from", type=Path, default=None,
                   help="the SFT policy's HF directory (default: make one first)")
    args = p.parse_args()
    if os.cpu_count() is None or len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench_async needs 2 cores (one for training, one for rollout)")
    with tempfile.TemporaryDirectory(prefix="bench_async_") as tmp:
        work = Path(tmp)
        policy = args.sft_from or sft_policy(work)
        runs: dict[str, list[dict]] = {}
        chosen = ["off"] + [m for m in args.modes.split(",") if m in MODES and m != "off"]
        for seed in range(args.seed, args.seed + args.seeds):  # seed-major: comparable halves
            for mode in chosen:
                print(f"rollout.async {mode}, seed {seed}: {args.steps} steps ...", flush=True)
                runs.setdefault(mode, []).append(run_mode(mode, Path(policy), work, args, seed))
                r = runs[mode][-1]
                print(f"  {r['step_s']:.2f} s/step, held-out {r['reward_start']:.3f} -> "
                      f"{r['reward']:.3f} +- {r['reward_se']:.3f}", flush=True)
    results = {mode: average(rs) for mode, rs in runs.items()}
    base = results["off"]
    if args.seeds > 1:
        print(f"\nmeans over {args.seeds} seeds ({args.seed} .. {args.seed + args.seeds - 1}); "
              "held-out reward: mean +- its standard error over the seeds (each seed's value in "
              "the last column)")
    print("\n| mode | s/step | speedup | trainer idle | rollout idle | held-out reward (start -> "
          "end +- se) | clip frac | staleness mean / max | behaviour ESS | pause s | "
          "resumed / re-queued | wall s |" + (" held-out per seed |" if args.seeds > 1 else ""))
    print("| --- " * (12 + (args.seeds > 1)) + "|")
    for mode, r in results.items():
        print(f"| {mode} | {r['step_s']:.2f} | {base['step_s'] / r['step_s']:.2f}x | "
              f"{r['trainer_idle']:.2f} | {r['rollout_idle']:.2f} | {r['reward_start']:.3f} -> "
              f"{r['reward']:.3f} +- {r['reward_se']:.3f} | {r['clip']:.4f} | "
              f"{r['staleness']:.2f} / {r['staleness_max']:.0f} | "
              f"{'-' if r['ess'] != r['ess'] else format(r['ess'], '.4f')} | "
              f"{r['paused']:.3f} | {r['resumed']:.0f} / {r['requeued']:.0f} | {r['wall_s']:.0f} |"
              + (f" {', '.join(f'{x:.3f}' for x in r['rewards'])} |" if args.seeds > 1 else ""))

    def speed(mode: str) -> str:
        return f"{base['step_s'] / results[mode]['step_s']:.2f}x" if mode in results else "n/a"

    def reward(mode: str) -> str:
        return f"{results[mode]['reward']:.3f}" if mode in results else "n/a"
    seeds = f" ({args.seeds} seeds)" if args.seeds > 1 else ""
    print(f"\nasync vs sync (separate cores){seeds}: one_step {speed('one_step')}, full {speed('full')}; "
          f"held-out reward sync {reward('off')}, one_step {reward('one_step')}, "
          f"full {reward('full')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
