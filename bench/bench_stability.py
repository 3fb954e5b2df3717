"""The GSPO paper's MoE stability claim, in miniature: one command runs the whole study grid.

    .venv/bin/python bench/bench_stability.py --out runs/bench_stability_long \
        --sft-from runs/bench_trl_long/sft/hf                       # the grid of docs/stability.md
    .venv/bin/python bench/bench_stability.py --out runs/bench_stability_long --report-only
    .venv/bin/python bench/bench_stability.py --out runs/bench_stability_smoke --smoke

What is compared (docs/stability.md explains every number this writes):

* **arms**: gspo, grpo, grpo + routing replay ``old`` (R2), grpo + routing replay ``rollout`` (R3),
  gspo_token and the three ablation variants (``seq_ratio_token_clip``, ``token_ratio_seq_clip``,
  ``seq_ratio_unnormalized``; megatron_gspo/loss/variants.py). Sequence-clip variants use the
  paper's range (``gspo.eps_low|high``, 3e-4 / 4e-4), token-ratio variants GRPO's
  (``gspo.token_eps_low|high``, 0.2 / 0.28): the config's defaults.
* **k** mini-batch updates per rollout (``gspo.updates_per_rollout``): 1, 4, 8.
* **learning rate**: a grid (``--lrs``) tuned per arm: each (arm, lr) is trained once at
  k = ``--tune-k`` on a tuning seed (``run.seed`` = ``--tune-seed``, never one of the reported
  seeds) and the lr with the highest FINAL held-out reward is chosen (ties: the smaller lr), then
  used for every k with ``--seeds`` other seeds. A grid of one lr skips tuning.
* **equal budgets**: every run has the same number of rollout steps (``--steps``), prompts per step
  (``--prompts``) and samples per prompt (``--group-size``): the same samples; k only splits each
  rollout batch into k mini-batches.
* **one start**: one cold-start SFT policy of a tiny Qwen3-MoE (default 4 layers, 16 experts,
  top-2, hidden 128) on the long-response carry task (``--digits 24``: 62-243 response tokens):
  ``--sft-from`` an existing one (its config.json must match the model flags), or
  ``megatron-gspo sft`` run once here and cached in ``<out>/sft/hf``.

Order: the tuning runs first, then the reported runs seed-major (seed 1 of every arm x k, then
seed 2, ...), so a grid stopped part-way has every cell at the same seeds. Per run
(``<out>/runs/<arm>_k<k>_lr<lr>_s<seed>/``: the run directory, its ``metrics.jsonl`` and
``result.json``): held-out reward before / after (and every ``--eval-interval`` steps), reward
collapses (:func:`find_collapse`), clip fractions, routing volatility
(``train/routing_change_frac``, ``..._any_frac``) and the variances of log w_it / log s_i
(``train/token_log_ratio_var``, ``train/seq_log_ratio_var``), each as a mean over steps and as the
per-step series. A run whose ``result.json`` exists is not run again (resumable; delete the file
to redo it). Outputs, rewritten after every run: ``<out>/results.json``, ``<out>/table.md``
(mean +- std over the seeds per arm x k, the tuning grid, how many runs are done); at the end (or
with ``--report-only``, which trains nothing) ``<out>/plots/stability_k<k>.png``.

``--smoke``: gspo and grpo, k in {1, 2}, 1 seed, 1 lr, 3 steps, a 2-layer 8-expert model, the short
addition task, a 60-step SFT: a check that the pipeline runs end to end (minutes), not a result.
Flags given next to ``--smoke`` win over the preset (``--smoke --arms grpo_replay_old --ks 2``).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]

# arm name -> (gspo.variant, gspo.routing_replay)
ARMS: dict[str, tuple[str, str]] = {
    "gspo": ("gspo", "none"),
    "grpo": ("grpo", "none"),
    "grpo_replay_old": ("grpo", "old"),
    "grpo_replay_rollout": ("grpo", "rollout"),
    "gspo_token": ("gspo_token", "none"),
    "seq_ratio_token_clip": ("seq_ratio_token_clip", "none"),
    "token_ratio_seq_clip": ("token_ratio_seq_clip", "none"),
    "seq_ratio_unnormalized": ("seq_ratio_unnormalized", "none"),
    "gspo_replay_rollout": ("gspo", "rollout"),  # GSPO + R3
    "cispo": ("cispo", "none"),
    "sapo": ("sapo", "none"),
    "luspo": ("luspo", "none"),
    "gmpo": ("gmpo", "none"),
}

# per-step series kept in result.json and plotted (metrics.jsonl names)
SERIES = {
    "train_reward": "train/reward_mean",
    "clip_frac_low": "train/clip_frac_low",
    "clip_frac_high": "train/clip_frac_high",
    "token_clip_frac_low": "train/token_clip_frac_low",
    "token_clip_frac_high": "train/token_clip_frac_high",
    "routing_change_frac": "train/routing_change_frac",
    "routing_change_any_frac": "train/routing_change_any_frac",
    "token_log_ratio_var": "train/token_log_ratio_var",
    "seq_log_ratio_var": "train/seq_log_ratio_var",
    "response_length_mean": "train/response_length_mean",  # LUSPO's length-collapse claim
    "sapo_gate_weight_mean": "train/sapo_gate_weight_mean",
}
EVAL = "eval/reward_mean"

SMOKE = dict(arms="gspo,grpo", ks="1,2", seeds=1, lrs="5e-4", steps=3, layers=2, experts=8, topk=2,
             hidden=64, ffn=64,
             task="addition", digits=2, sft_steps=60, prompts=8, eval_prompts=16, eval_interval=0)


# ------------------------------------------------------------------------------------------------
# pure parts (tests/unit/test_bench_stability.py)


def find_collapse(rewards: Sequence[float], *, frac: float = 0.5, patience: int = 3,
                  window: int = 3, floor: float = 0.05) -> Optional[int]:
    """The first step index at which the training reward has COLLAPSED, or None.

    Definition: let m_t be the trailing mean of the last ``window`` rewards (fewer at the start)
    and M_t = max_{s <= t} m_s its running maximum. The run collapses at the first t that ends
    ``patience`` consecutive steps u with m_u < frac * M_u, counted only once M_u >= ``floor`` (a
    run that never reached ``floor`` cannot collapse: falling from ~0 to 0 is noise). The index
    returned is that of the first of those ``patience`` steps.
    """
    means, peak, run = [], float("-inf"), 0
    for t, r in enumerate(rewards):
        means.append(r)
        m = sum(means[-window:]) / len(means[-window:])
        peak = max(peak, m)
        if peak >= floor and m < frac * peak:
            run += 1
            if run >= patience:
                return t - patience + 1
        else:
            run = 0
    return None


def held_out_collapsed(curve: Sequence[tuple[int, float]], *, frac: float = 0.5,
                       floor: float = 0.05) -> bool:
    """The held-out reward collapsed: some evaluation after the first is below ``frac`` x the
    maximum of the evaluations before it (step 0, the SFT policy, included), that maximum being
    >= ``floor``. Held-out evaluations are sparse, so one is enough (no patience)."""
    peak = float("-inf")
    for i, (_, value) in enumerate(curve):
        if i and peak >= floor and value < frac * peak:
            return True
        peak = max(peak, value)
    return False


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value); NaN for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    if len(vals) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))


def choose_lr(tuning: dict[float, float]) -> float:
    """The lr with the highest held-out reward on the tuning seed; ties go to the smaller lr."""
    best = max(tuning.values())
    return min(lr for lr, reward in tuning.items() if reward == best)


def run_key(arm: str, k: int, lr: float, seed: int) -> str:
    return f"{arm}_k{k}_lr{lr:g}_s{seed}"


def summarize(records: list[dict], *, collapse_kw: Optional[dict] = None) -> dict:
    """One run's result from its metrics.jsonl records (one dict per logged step)."""
    train = [r for r in records if SERIES["train_reward"] in r]
    steps = [r["step"] for r in train]
    series = {name: [r.get(key) for r in train] for name, key in SERIES.items()}
    evals = [(r["step"], r[EVAL]) for r in records if EVAL in r]
    rewards = series["train_reward"]
    collapse = find_collapse(rewards, **(collapse_kw or {}))

    def avg(name: str) -> Optional[float]:
        vals = [v for v in series[name] if v is not None]
        return sum(vals) / len(vals) if vals else None

    # a variant reports either the sequence clip fractions or the token ones: the one it has
    clip_low = avg("clip_frac_low") if avg("clip_frac_low") is not None else avg("token_clip_frac_low")
    clip_high = (avg("clip_frac_high") if avg("clip_frac_high") is not None
                 else avg("token_clip_frac_high"))
    clip_unit = ("sequence" if avg("clip_frac_low") is not None else
                 "token" if avg("token_clip_frac_low") is not None else "none (soft gate)")
    eval_start = evals[0][1] if evals and evals[0][0] == 0 else None
    eval_final = evals[-1][1] if evals else None
    return {
        "steps": len(train),
        "eval_start": eval_start, "eval_final": eval_final,
        "eval_delta": (eval_final - eval_start) if eval_start is not None and eval_final is not None
        else None,
        "eval_curve": evals,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
        "collapse_step": steps[collapse] if collapse is not None else None,
        "collapsed": collapse is not None,
        "eval_collapsed": held_out_collapsed(
            evals, frac=(collapse_kw or {}).get("frac", 0.5),
            floor=(collapse_kw or {}).get("floor", 0.05)),
        "clip_unit": clip_unit, "clip_frac_low": clip_low, "clip_frac_high": clip_high,
        "clip_frac": (clip_low or 0.0) + (clip_high or 0.0) if clip_low is not None else None,
        "routing_change_frac": avg("routing_change_frac"),
        "routing_change_any_frac": avg("routing_change_any_frac"),
        "token_log_ratio_var": avg("token_log_ratio_var"),
        "seq_log_ratio_var": avg("seq_log_ratio_var"),
        "response_length_mean": avg("response_length_mean"),
        "sapo_gate_weight_mean": avg("sapo_gate_weight_mean"),
        "series": {"step": steps, **series},
    }


def fmt(values: Sequence[Optional[float]], digits: int = 3, sci: bool = False) -> str:
    mean, std = mean_std([v for v in values if v is not None])
    if math.isnan(mean):
        return "-"
    f = (lambda x: f"{x:.2e}") if sci else (lambda x: f"{x:.{digits}f}")
    return f"{f(mean)} +- {f(std)}" if len(values) > 1 else f(mean)


def cell_runs(results: dict, arm: str, k: int) -> list[dict]:
    """The reported runs (chosen lr, every seed) of one arm x k cell that have results."""
    cell = results.get("cells", {}).get(f"{arm}/k{k}")
    return [results["runs"][key] for key in (cell or {}).get("runs", []) if key in results["runs"]]


def make_table(results: dict, arms: Sequence[str], ks: Sequence[int]) -> str:
    """Markdown, one row per arm x k: mean +- std over the seeds (the chosen lr's runs)."""
    head = ("| arm | k | lr (grid best) | seeds | held-out before | held-out after | change | "
            "collapses (train / held-out) | clip frac (low + high) | routing change frac | any-layer change | "
            "var log w_it | var log s_i | s / run |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for k in ks:
        for arm in arms:
            runs = cell_runs(results, arm, k)
            if not runs:
                continue
            col = lambda name: [r.get(name) for r in runs]
            collapses = (f"{sum(1 for r in runs if r['collapsed'])} / "
                         f"{sum(1 for r in runs if r.get('eval_collapsed'))} of {len(runs)}")
            unit = runs[0]["clip_unit"][:3]
            lines.append(
                f"| {arm} | {k} | {results['cells'][f'{arm}/k{k}']['lr']:g} | {len(runs)} | {fmt(col('eval_start'))} | "
                f"{fmt(col('eval_final'))} | {fmt(col('eval_delta'))} | {collapses} | "
                f"{fmt(col('clip_frac'))} ({unit}) | {fmt(col('routing_change_frac'))} | "
                f"{fmt(col('routing_change_any_frac'))} | {fmt(col('token_log_ratio_var'), sci=True)} | "
                f"{fmt(col('seq_log_ratio_var'), sci=True)} | {fmt(col('seconds'), 0)} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# running


def cli(*cmd: str) -> list[str]:
    return ["nice", "-n", "10", sys.executable, "-m", "launch.cli", *cmd]


def lengths(args) -> tuple[int, int]:
    """(rollout.max_new_tokens, run.seq_length) for the task."""
    if args.task == "addition":
        return 6, 16
    # carry trace: 10 n + 3 tokens with the end token for n <= digits columns; prompt <= 2 n + 2
    new = 10 * args.digits + 3
    return new, new + 2 * args.digits + 4


def common_overrides(args) -> list[str]:
    new, seq = lengths(args)
    m = {"model.num_layers": args.layers, "model.hidden_size": args.hidden,
         "model.num_attention_heads": args.heads, "model.num_query_groups": args.kv_heads,
         "model.head_dim": args.head_dim, "model.num_experts": args.experts,
         "model.moe_router_topk": args.topk, "model.moe_ffn_hidden_size": args.ffn,
         "model.max_position_embeddings": max(64, seq), "data.task": args.task,
         "data.digits": args.digits, "run.seq_length": seq, "rollout.max_new_tokens": new,
         "data.num_eval_prompts": args.eval_prompts}
    return [x for key, v in m.items() for x in ("--set", f"{key}={v}")]


def run_cli(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd[3:])}\n{tail}")


# --sft-from's config.json must agree with the model flags (name in config.json -> flag)
_SFT_FIELDS = {"num_hidden_layers": "layers", "hidden_size": "hidden", "num_attention_heads": "heads",
               "num_key_value_heads": "kv_heads", "head_dim": "head_dim", "num_experts": "experts",
               "num_experts_per_tok": "topk", "moe_intermediate_size": "ffn"}


def check_sft_from(args, hf: Path) -> Path:
    """``--sft-from``: an existing Hugging Face policy; its shape must be the model flags'."""
    path = hf / "config.json"
    if not path.is_file():
        raise SystemExit(f"--sft-from {hf}: no config.json there (a Hugging Face directory is needed)")
    config = json.loads(path.read_text())
    wrong = [f"{name} = {config.get(name)} but --{flag.replace('_', '-')} {getattr(args, flag)}"
             for name, flag in _SFT_FIELDS.items() if config.get(name) != getattr(args, flag)]
    if wrong:
        raise SystemExit(f"--sft-from {path}: " + "; ".join(wrong))
    return hf


def ensure_sft(args, out: Path) -> Path:
    if args.sft_from:
        return check_sft_from(args, Path(args.sft_from))
    sft = out / "sft"
    hf = sft / "hf"
    if (hf / "config.json").is_file():
        return hf
    if sft.exists():
        import shutil

        shutil.rmtree(sft)
    print(f"SFT ({args.sft_steps} steps) -> {hf}", flush=True)
    start = time.monotonic()
    run_cli(cli("sft", "--config", "launch/configs/tiny_cpu_sft.yaml", *common_overrides(args),
                "--set", f"run.output_dir={sft}", "--set", f"run.seed={args.sft_seed}",
                "--set", f"run.num_steps={args.sft_steps}", "--set", f"optim.lr={args.sft_lr}",
                "--set", "run.log_interval=50", "--set", f"run.eval_interval={args.sft_steps}",
                "--set", f"run.global_batch_size={args.sft_batch}"), out / "logs" / "sft.log")
    (out / "sft_seconds.json").write_text(json.dumps({"seconds": time.monotonic() - start}))
    return hf


def micro_batch(args, k: int) -> int:
    """The largest micro-batch <= --micro-batch dividing one rank's share of a mini-batch."""
    per_rank = args.prompts * args.group_size // k // 2  # 2 ranks (EP 2: data parallel 2)
    return math.gcd(args.micro_batch, max(1, per_rank))


def train_one(args, out: Path, sft_hf: Path, arm: str, k: int, lr: float,
              seed: int) -> Optional[dict]:
    """One run's result: read back if its result.json exists, else trained now (None under
    ``--report-only``)."""
    key = run_key(arm, k, lr, seed)
    run_dir = out / "runs" / key
    result_path = run_dir / "result.json"
    if result_path.is_file():  # done: its summary is recomputed (the definitions may have changed)
        result = json.loads(result_path.read_text())
        if (run_dir / "metrics.jsonl").is_file():
            sys.path.insert(0, str(ROOT))
            from pipeline.observe.metrics import read_metrics

            result.update(summarize(read_metrics(run_dir), collapse_kw=collapse_kw(args)))
        return result
    if args.report_only:
        return None
    if run_dir.exists():  # an interrupted run: start it again from scratch
        import shutil

        shutil.rmtree(run_dir)
    variant, replay = ARMS[arm]
    eval_interval = args.eval_interval or args.steps
    print(f"run {key}", flush=True)
    start = time.monotonic()
    run_cli(cli("train", "--config", "launch/configs/tiny_cpu.yaml", *common_overrides(args),
                "--set", f"run.output_dir={run_dir}", "--set", f"run.init_from={sft_hf}",
                "--set", f"run.seed={seed}", "--set", f"gspo.variant={variant}",
                "--set", f"gspo.routing_replay={replay}", "--set", "gspo.routing_metrics=true",
                "--set", f"gspo.updates_per_rollout={k}", "--set", f"gspo.group_size={args.group_size}",
                "--set", f"run.global_batch_size={args.prompts * args.group_size}",
                "--set", f"run.micro_batch_size={micro_batch(args, k)}",
                "--set", f"run.num_steps={args.steps}", "--set", f"run.eval_interval={eval_interval}",
                "--set", "run.save_interval=0", "--set", "run.log_interval=1",
                "--set", f"optim.lr={lr}"), run_dir.parent / f"{key}.log")
    sys.path.insert(0, str(ROOT))
    from pipeline.observe.metrics import read_metrics

    result = {**summarize(read_metrics(run_dir), collapse_kw=collapse_kw(args)),
              "arm": arm, "variant": variant, "routing_replay": replay, "k": k, "lr": lr,
              "seed": seed, "seconds": time.monotonic() - start}
    result_path.write_text(json.dumps(result, indent=1))
    print(f"  {key}: held-out {result['eval_start']} -> {result['eval_final']}, collapsed "
          f"{result['collapsed']}, {result['seconds']:.0f} s", flush=True)
    return result


def collapse_kw(args) -> dict:
    return {"frac": args.collapse_frac, "patience": args.collapse_patience,
            "window": args.collapse_window, "floor": args.collapse_floor}


# ------------------------------------------------------------------------------------------------
# plots


def plot(results: dict, arms: Sequence[str], ks: Sequence[int], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("held-out reward", None), ("train reward", "train_reward"),
              ("clip fraction (low + high)", "clip"), ("routing_change_frac", "routing_change_frac"),
              ("var log w_it (tokens)", "token_log_ratio_var"),
              ("var log s_i (sequences)", "seq_log_ratio_var")]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    colors = plt.get_cmap("tab10")
    for k in ks:
        fig, axes = plt.subplots(2, 3, figsize=(15, 8))
        for i, arm in enumerate(arms):
            runs = cell_runs(results, arm, k)
            if not runs:
                continue
            for ax, (title, name) in zip(axes.flat, panels):
                if name is None:  # held-out: per-seed curves averaged on the common eval steps
                    curves = [dict(map(tuple, r["eval_curve"])) for r in runs]
                    xs = sorted(set.intersection(*[set(c) for c in curves])) if curves else []
                    ys = [[c[x] for c in curves] for x in xs]
                else:
                    s = runs[0]["series"]["step"]
                    xs = list(s)
                    def value(r, j):
                        sr = r["series"]
                        if name == "clip":
                            lo = sr["clip_frac_low"][j] if sr["clip_frac_low"][j] is not None \
                                else sr["token_clip_frac_low"][j]
                            hi = sr["clip_frac_high"][j] if sr["clip_frac_high"][j] is not None \
                                else sr["token_clip_frac_high"][j]
                            return None if lo is None else lo + (hi or 0.0)
                        return sr[name][j]
                    ys = [[value(r, j) for r in runs if j < len(r["series"]["step"])]
                          for j in range(len(xs))]
                pts = [(x, *mean_std([v for v in y if v is not None])) for x, y in zip(xs, ys)]
                pts = [p for p in pts if not math.isnan(p[1])]
                if not pts:
                    continue
                px, pm, ps = zip(*pts)
                ax.plot(px, pm, label=arm, color=colors(i % 10), marker="." if len(px) < 12 else None)
                if len(runs) > 1:
                    ax.fill_between(px, [m - s for m, s in zip(pm, ps)],
                                    [m + s for m, s in zip(pm, ps)], color=colors(i % 10), alpha=0.15)
        for ax, (title, name) in zip(axes.flat, panels):
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("rollout step")
            if name in ("token_log_ratio_var", "seq_log_ratio_var") and ax.has_data():
                ax.set_yscale("symlog", linthresh=1e-8)
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"k = {k} update(s) per rollout: mean over seeds (band: +- std)")
        fig.tight_layout()
        path = out_dir / f"stability_k{k}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def plot_summary(results: dict, arms: Sequence[str], ks: Sequence[int], out_dir: Path) -> Path:
    """One figure across k: per arm, the mean +- std over seeds of the held-out reward after
    training, the clip fraction, the routing change and the two log-ratio variances."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (title, result field, symlog threshold or None for a linear axis)
    panels = [("held-out reward after training", "eval_final", None),
              ("clip fraction (low + high; seq or tok, see table)", "clip_frac", 1e-4),
              ("routing_change_frac (token, layer)", "routing_change_frac", None),
              ("var log w_it (tokens)", "token_log_ratio_var", 1e-8),
              ("var log s_i (sequences)", "seq_log_ratio_var", 1e-8)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    colors = plt.get_cmap("tab10")
    for i, arm in enumerate(arms):
        for ax, (title, name, log) in zip(axes, panels):
            pts = []
            for k in ks:
                mean, std = mean_std([r.get(name) for r in cell_runs(results, arm, k)])
                if not math.isnan(mean):
                    pts.append((k, mean, std))
            if not pts:
                continue
            x, m, sd = zip(*pts)
            ax.errorbar([v + 0.08 * (i - len(arms) / 2) for v in x], m, yerr=sd, label=arm,
                        color=colors(i % 10), marker="o", ms=4, capsize=2)
    for ax, (title, name, log) in zip(axes, panels):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("k (updates per rollout)")
        ax.set_xticks(list(ks))
        if log and ax.has_data():
            ax.set_yscale("symlog", linthresh=log)
    axes[0].legend(fontsize=7)
    fig.suptitle("mean over the reported seeds (bars: +- std)", fontsize=10)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "stability_summary.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/bench_stability")
    p.add_argument("--smoke", action="store_true", help="the small end-to-end check (see above)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {', '.join(ARMS)}")
    p.add_argument("--ks", default="1,4,8")
    p.add_argument("--lrs", default="3e-5,1e-4,3e-4", help="the lr grid (every arm, at --tune-k)")
    p.add_argument("--tune-k", type=int, default=4,
                   help="k of the lr-tuning runs; the lr chosen there is used for every k")
    p.add_argument("--seeds", type=int, default=3, help="reported seeds: run.seed 1 .. N")
    p.add_argument("--tune-seed", type=int, default=0, help="run.seed of the lr-tuning runs")
    p.add_argument("--steps", type=int, default=20, help="rollout steps per run (equal budget)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per rollout step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--eval-interval", type=int, default=0, help="0: held-out only before/after")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts (x 4 samples)")
    p.add_argument("--task", choices=["addition", "carry_addition"], default="carry_addition")
    p.add_argument("--digits", type=int, default=24,
                   help="carry_addition: up to this many columns (10 n + 3 response tokens)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--sft-steps", type=int, default=2000)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--sft-seed", type=int, default=1234)
    p.add_argument("--collapse-frac", type=float, default=0.5)
    p.add_argument("--collapse-patience", type=int, default=3)
    p.add_argument("--collapse-window", type=int, default=3)
    p.add_argument("--collapse-floor", type=float, default=0.05)
    p.add_argument("--only-sft", action="store_true", help="run (or reuse) the SFT and stop")
    p.add_argument("--sft-from", default=None,
                   help="an existing Hugging Face policy to start every run from, instead of "
                        "<out>/sft/hf (its config.json must match the model flags)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: table, results.json and plots from the runs done so far")
    args = p.parse_args(argv)
    if args.smoke:  # the preset's values, except where a flag was given explicitly
        for key, value in SMOKE.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    for arm in args.arms.split(","):
        if arm not in ARMS:
            p.error(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    return args


def tuning_table(results: dict, arms: Sequence[str], lrs: Sequence[float], tune_k: int) -> str:
    """Markdown: the held-out reward after training of each (arm, lr) on the tuning seed."""
    lines = ["| arm | " + " | ".join(f"lr {x:g}" for x in lrs) + " | chosen |",
             "|" + "|".join(["---"] * (len(lrs) + 2)) + "|"]
    for arm in arms:
        t = results["tuning"].get(arm) or {}
        if not t:
            continue
        cells = []
        for x in lrs:
            r = results["runs"].get(run_key(arm, tune_k, x, results["setup"]["tune_seed"]))
            cells.append("-" if r is None or r["eval_final"] is None else
                         f"{r['eval_final']:.3f}" + (" (collapsed)" if r["collapsed"] else ""))
        chosen = results["chosen_lr"].get(arm)
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {'-' if chosen is None else f'{chosen:g}'} |")
    return "\n".join(lines) + "\n"


def write_report(results: dict, arms, ks, lrs, args, out: Path) -> str:
    table = make_table(results, arms, ks)
    text = table
    if len(lrs) > 1:
        text += (f"\nlr tuning at k = {args.tune_k} (held-out reward after training, tuning seed "
                 f"{args.tune_seed}; the chosen lr is used for every k):\n\n"
                 + tuning_table(results, arms, lrs, args.tune_k))
    done = sum(len(c["runs"]) for c in results["cells"].values())
    planned = len(arms) * len(ks) * args.seeds
    text += f"\nreported runs done: {done} of {planned}\n"
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return text


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = args.arms.split(",")
    ks = [int(x) for x in args.ks.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    seeds = list(range(1, args.seeds + 1))
    if args.tune_seed in seeds:
        raise SystemExit(f"--tune-seed {args.tune_seed} is one of the reported seeds {seeds}")
    t0 = time.monotonic()
    sft_hf = ensure_sft(args, out) if not args.report_only else Path(args.sft_from or out / "sft" / "hf")
    if args.only_sft:
        return 0
    results: dict = {"setup": {k: v for k, v in vars(args).items()}, "runs": {}, "cells": {},
                     "tuning": {}, "chosen_lr": {}}
    # 1. the lr, per arm: every lr of the grid at k = --tune-k on the tuning seed
    for arm in arms:
        if len(lrs) == 1:
            results["chosen_lr"][arm] = lrs[0]
            continue
        tuning = {}
        for lr in lrs:
            r = train_one(args, out, sft_hf, arm, args.tune_k, lr, args.tune_seed)
            if r is not None:
                results["runs"][run_key(arm, args.tune_k, lr, args.tune_seed)] = r
                tuning[lr] = r["eval_final"] if r["eval_final"] is not None else float("-inf")
        results["tuning"][arm] = {f"{x:g}": v for x, v in tuning.items()}
        results["chosen_lr"][arm] = choose_lr(tuning) if len(tuning) == len(lrs) else None
        write_report(results, arms, ks, lrs, args, out)
    # 2. the reported runs, seed-major: a grid stopped part-way has every cell at the same seeds
    for seed in seeds:
        for k in ks:
            for arm in arms:
                lr = results["chosen_lr"][arm]
                if lr is None:  # --report-only before its tuning finished
                    continue
                r = train_one(args, out, sft_hf, arm, k, lr, seed)
                cell = results["cells"].setdefault(f"{arm}/k{k}", {"lr": lr, "runs": []})
                if r is not None:
                    key = run_key(arm, k, lr, seed)
                    results["runs"][key] = r
                    cell["runs"].append(key)
                write_report(results, arms, ks, lrs, args, out)
    results["wall_s"] = time.monotonic() - t0
    text = write_report(results, arms, ks, lrs, args, out)
    print(text)
    for path in [*plot(results, arms, ks, out / "plots"),
                 plot_summary(results, arms, ks, out / "plots")]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
