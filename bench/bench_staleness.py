"""GSPO under staleness, in miniature: ``rollout.async: full`` with eta = rollout.max_staleness in
{0, 1, 2, 4}, the decoupled objective (``gspo.old_logprobs: recompute``, the behaviour weight)
against the bypass one (``gspo.old_logprobs: rollout``), over seeds.

Run (about 25 minutes on the 2-core CPU machine for the default 2 x 4 x 3 runs, after the SFT
policy; resumable: finished runs are read back from ``--out``):

    .venv/bin/python bench/bench_staleness.py --out runs/bench_staleness
    .venv/bin/python bench/bench_staleness.py --out runs/bench_staleness --etas 0,2 --seeds 1

Every run starts from the demo's SFT policy (launch/configs/tiny_cpu_sft.yaml, made first unless
``--sft-from`` names one) and trains launch/configs/tiny_cpu.yaml for ``--steps`` steps of
``--batch`` samples, embedded servers, evaluated at the start and the end. Reported per arm (mean
+- standard error over the seeds):

* held-out reward at the end, and the collapse rate (runs whose held-out reward ends more than
  ``--collapse-drop`` below where it started);
* the GSPO clip fraction (mean over steps) and the staleness actually trained (mean, max);
* the behaviour weights' effective sample size (``mismatch_weight_ess``; 1 for bypass, whose
  ratio is taken against the behaviour policy itself), which VCPO (arXiv 2602.17616) reports
  to predict collapse.

The last line: ``staleness study: <arms> runs; worst decoupled clip fraction X.XXXX (eta N),
worst bypass Y.YYYY (eta M)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMS = {"decoupled": ["gspo.old_logprobs=recompute"], "bypass": ["gspo.old_logprobs=rollout"]}


def cli(*args: str, timeout: float = 1800) -> None:
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"megatron-gspo {' '.join(args[:3])} ... exited {proc.returncode}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def one_run(out: Path, policy: Path, form: str, eta: int, seed: int, args) -> dict:
    """One arm and seed (read back when its summary exists: the study is resumable)."""
    from pipeline.observe.metrics import read_metrics

    run_dir = out / f"{form}_eta{eta}_seed{seed}"
    summary = run_dir / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    if run_dir.exists():  # an interrupted run: made again
        import shutil

        shutil.rmtree(run_dir)
    print(f"  {form} eta {eta} seed {seed} ...", flush=True)
    sets = [f"run.output_dir={run_dir}", f"run.init_from={policy}", f"run.seed={seed}",
            f"run.num_steps={args.steps}", f"run.global_batch_size={args.batch}",
            f"run.eval_interval={args.steps}", "run.save_interval=0", "rollout.async=full",
            f"rollout.max_staleness={eta}", *FORMS[form]]
    cli("train", "--config", "launch/configs/tiny_cpu.yaml", *[a for s in sets for a in ("--set", s)])
    records = read_metrics(run_dir)
    train = [r for r in records if "train/reward_mean" in r]
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]

    def mean(key):
        values = [r[key] for r in train if key in r]
        return statistics.fmean(values) if values else float("nan")
    result = {"form": form, "eta": eta, "seed": seed, "reward_start": evals[0],
              "reward_end": evals[-1], "collapsed": evals[-1] < evals[0] - args.collapse_drop,
              "clip": mean("train/clip_frac"), "staleness": mean("train/staleness_mean"),
              "staleness_max": max(r.get("train/staleness_max", 0.0) for r in train),
              "ess": mean("train/mismatch_weight_ess"),
              "requeued": sum(r.get("train/requeued", 0.0) for r in train)}
    summary.write_text(json.dumps(result))
    return result


def mean_se(values: list[float]) -> str:
    if any(v != v for v in values):  # NaN: the metric does not exist in that arm (bypass ESS)
        return "-"
    m = statistics.fmean(values)
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{m:.3f} +- {se:.3f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="study directory (resumable)")
    p.add_argument("--etas", default="0,1,2,4", help="rollout.max_staleness values")
    p.add_argument("--forms", default="decoupled,bypass", help="objective forms")
    p.add_argument("--seeds", type=int, default=3, help="seeds per arm (1..N)")
    p.add_argument("--steps", type=int, default=12, help="training steps per run")
    p.add_argument("--batch", type=int, default=128, help="run.global_batch_size")
    p.add_argument("--collapse-drop", type=float, default=0.2,
                   help="a run whose held-out reward ends this far below its start collapsed")
    p.add_argument("--sft-from", type=Path, default=None,
                   help="the SFT policy's HF directory (default: make one first, in --out)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    policy = args.sft_from
    if policy is None:
        policy = args.out / "sft" / "hf"
        if not policy.is_dir():
            print("SFT policy (launch/configs/tiny_cpu_sft.yaml) ...", flush=True)
            cli("sft", "--config", "launch/configs/tiny_cpu_sft.yaml",
                "--set", f"run.output_dir={args.out / 'sft'}", "--set", "run.eval_interval=0",
                "--set", "run.log_interval=100")
    etas = [int(x) for x in args.etas.split(",")]
    forms = [f for f in args.forms.split(",") if f in FORMS]
    rows = []
    for form in forms:
        for eta in etas:
            runs = [one_run(args.out, policy, form, eta, seed, args)
                    for seed in range(1, args.seeds + 1)]
            rows.append((form, eta, runs))
    print("\n| form | eta | held-out reward start | end | collapsed | clip frac | staleness "
          "mean / max | behaviour ESS | re-queued |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for form, eta, runs in rows:
        print(f"| {form} | {eta} | {mean_se([r['reward_start'] for r in runs])} | "
              f"{mean_se([r['reward_end'] for r in runs])} | "
              f"{sum(r['collapsed'] for r in runs)}/{len(runs)} | "
              f"{mean_se([r['clip'] for r in runs])} | "
              f"{statistics.fmean(r['staleness'] for r in runs):.2f} / "
              f"{max(r['staleness_max'] for r in runs):.0f} | "
              f"{mean_se([r['ess'] for r in runs])} | "
              f"{sum(r['requeued'] for r in runs):.0f} |")

    def worst(form: str) -> str:
        arms = [(statistics.fmean(r["clip"] for r in runs), eta)
                for f, eta, runs in rows if f == form]
        if not arms:
            return "n/a"
        clip, eta = max(arms)
        return f"{clip:.4f} (eta {eta})"
    print(f"\nstaleness study: {sum(len(r) for _, _, r in rows)} runs; worst decoupled clip "
          f"fraction {worst('decoupled')}, worst bypass {worst('bypass')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
