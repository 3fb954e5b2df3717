"""GSPO against GRPO and the three ablation variants, in miniature (the paper's claim).

Same task (2-digit addition), same SFT start, same budget (steps, batch, group size) for every
variant; 3 seeds each; k = 1 and k = 4 mini-batch updates per rollout. Reports the final held-out
reward, the largest drop of the training reward (a collapse measure), and the clip fractions.

    python bench/bench_variants.py --out runs/bench_variants [--steps 25] [--seeds 3] [--batch 128]

Writes ``<out>/results.json``, ``<out>/variants.png`` and prints a markdown table (copied into
docs/performance.md). Sequence-clip variants use the paper's range (3e-4 / 4e-4), token-clip
variants GRPO's (0.2 / 0.28).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ["gspo", "grpo", "seq_ratio_token_clip", "token_ratio_seq_clip", "seq_ratio_unnormalized"]


def run(cmd: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *cmd], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def summarize(run_dir: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from pipeline.observe.metrics import read_metrics

    records = read_metrics(run_dir)
    train = [r["train/reward_mean"] for r in records if "train/reward_mean" in r]
    evals = [r["eval/reward_mean"] for r in records if "eval/reward_mean" in r]
    peak, drop = float("-inf"), 0.0
    for value in train:
        peak = max(peak, value)
        drop = max(drop, peak - value)
    clip = lambda key: sum(r.get(key, 0.0) for r in records[1:]) / max(1, len(records) - 1)
    return {"eval_start": evals[0], "eval_final": evals[-1], "max_reward_drop": drop,
            "clip_frac_low": clip("train/clip_frac_low") or clip("train/token_clip_frac_low"),
            "clip_frac_high": clip("train/clip_frac_high") or clip("train/token_clip_frac_high")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_variants")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batch", type=int, default=128, help="sequences per rollout step")
    args = parser.parse_args()
    out = Path(args.out)
    sft = out / "sft"
    if not (sft / "hf" / "config.json").is_file():
        run(["sft", "--config", "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={sft}"])
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for k in [int(x) for x in args.ks.split(",")]:
        for variant in args.variants.split(","):
            for seed in range(args.seeds):
                key = f"{variant}/k{k}/seed{seed}"
                if key in results:
                    continue
                run_dir = out / key.replace("/", "_")
                start = time.monotonic()
                run(["train", "--config", "launch/configs/tiny_cpu.yaml",
                     "--set", f"run.output_dir={run_dir}", "--set", f"run.init_from={sft / 'hf'}",
                     "--set", f"run.seed={1000 + seed}", "--set", f"gspo.variant={variant}",
                     "--set", f"gspo.updates_per_rollout={k}", "--set", f"run.num_steps={args.steps}",
                     "--set", f"run.eval_interval={args.steps}", "--set", "run.save_interval=0",
                     "--set", f"run.global_batch_size={args.batch}",
                     "--set", "run.log_interval=1000"])
                results[key] = {**summarize(run_dir), "seconds": time.monotonic() - start}
                results_path.write_text(json.dumps(results, indent=1))
                print(key, results[key], flush=True)
    table = ["| variant | k | held-out start | held-out final (mean over seeds) | max train-reward drop | "
             "clip low | clip high |", "|---|---|---|---|---|---|---|"]
    for k in [int(x) for x in args.ks.split(",")]:
        for variant in args.variants.split(","):
            rows = [v for key, v in results.items() if key.startswith(f"{variant}/k{k}/")]
            if not rows:
                continue
            mean = lambda f: sum(r[f] for r in rows) / len(rows)
            finals = ", ".join(f"{r['eval_final']:.3f}" for r in rows)
            table.append(f"| {variant} | {k} | {mean('eval_start'):.3f} | {mean('eval_final'):.3f} "
                         f"({finals}) | {mean('max_reward_drop'):.3f} | {mean('clip_frac_low'):.3f} | "
                         f"{mean('clip_frac_high'):.3f} |")
    print("\n".join(table))
    (out / "table.md").write_text("\n".join(table) + "\n")
    plot(results, [int(x) for x in args.ks.split(",")], args.variants.split(","),
         out / "variants.png")
    return 0


def plot(results: dict, ks: list[int], variants: list[str], path: Path) -> None:
    """Final held-out reward per variant (one dot per seed, bar = mean) for each k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(ks), figsize=(5 * len(ks), 4), sharey=True)
    axes = [axes] if len(ks) == 1 else list(axes)
    for ax, k in zip(axes, ks):
        for x, variant in enumerate(variants):
            finals = [v["eval_final"] for key, v in results.items()
                      if key.startswith(f"{variant}/k{k}/")]
            starts = [v["eval_start"] for key, v in results.items()
                      if key.startswith(f"{variant}/k{k}/")]
            if not finals:
                continue
            ax.bar(x, sum(finals) / len(finals), color="tab:blue", alpha=0.5)
            ax.scatter([x] * len(finals), finals, color="tab:blue", zorder=3, s=14)
            ax.hlines(sum(starts) / len(starts), x - 0.4, x + 0.4, colors="black",
                      linestyles="dashed", linewidth=1)
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels(variants, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"k = {k} update(s) per rollout")
    axes[0].set_ylabel("held-out exact match (dashed: SFT start)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
