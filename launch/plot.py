"""``megatron-gspo plot``: PNG charts of a run's ``metrics.jsonl``.

    megatron-gspo plot runs/tiny_cpu                 # writes runs/tiny_cpu/plots/*.png
    megatron-gspo plot runs/tiny_cpu --out docs/img

Charts (each skipped, with a note, when its metrics are absent from the file):
  reward.png           train reward mean +- std, held-out reward and pass@1, zero-std group share
  clip_fraction.png    sequences clipped on the low side and on the high side
  log_ratio.png        log s_i: mean, +-std and min..max bands over steps; a histogram of chosen
                       steps when the loop logs the per-sequence values (train/log_ratio_seq_values)
  response_length.png  response length mean and max
  entropy.png          mean token entropy
  mismatch.png         |log-prob(rollout) - log-prob(trainer)|, mean over tokens
  routing.png          routing volatility: share of (token, layer) pairs and of tokens whose top-k
                       expert set changed over the step's updates, and per layer (docs/routing.md)
  log_ratio_var.png    variance of log w_it over tokens and of log s_i over sequences, per step
  grad_norm.png, throughput.png (rollout / training tokens per second), loss.png (SFT runs)
  tool_calls.png       multi-turn runs (docs/tools.md): tool calls, tool errors and model turns per
                       trajectory, training and held-out
  end_reasons.png      multi-turn runs: the share of trajectories ended by each reason
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Optional

# The metric names the loop logs (pipeline/step/loop.py follows them).
REWARD_MEAN, REWARD_STD = "train/reward_mean", "train/reward_std"
ZERO_STD_FRAC = "train/zero_std_group_frac"
LENGTH_MEAN, LENGTH_MAX = "train/response_length_mean", "train/response_length_max"
LOG_RATIO = {stat: f"train/log_ratio_seq_{stat}" for stat in ("mean", "std", "min", "max")}
LOG_RATIO_VALUES = ("train/log_ratio_seq_values", "log_ratio_seq_values")
CLIP_LOW, CLIP_HIGH = "train/clip_frac_low", "train/clip_frac_high"
ENTROPY, GRAD_NORM = "train/entropy_mean", "train/grad_norm"
MISMATCH = "train/rollout_trainer_logprob_abs_diff"
ROUTING_CHANGE, ROUTING_CHANGE_ANY = "train/routing_change_frac", "train/routing_change_any_frac"
ROUTING_CHANGE_LAYER = re.compile(r"train/routing_change_frac_layer(\d+)")
TOKEN_LOG_RATIO_VAR, SEQ_LOG_RATIO_VAR = "train/token_log_ratio_var", "train/seq_log_ratio_var"
ROLLOUT_TPS, TRAIN_TPS = "train/rollout_tokens_per_s", "train/train_tokens_per_s"
EVAL_REWARD, EVAL_PASS1 = "eval/reward_mean", "eval/pass_at_1"
TRAIN_LOSS, EVAL_LOSS = "train/loss", "eval/loss"

Series = tuple[list[int], list[float]]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plot", help="write PNG charts of a run's metrics.jsonl",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="where to write the PNGs (default: RUN_DIR/plots)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "metrics.jsonl").is_file():
        print(f"megatron-gspo plot: {run_dir / 'metrics.jsonl'} not found")
        return 2
    out = Path(args.out) if args.out else run_dir / "plots"
    written = plot_run(run_dir, out)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"megatron-gspo plot: no known metrics in {run_dir / 'metrics.jsonl'}")
        return 1
    return 0


# ------------------------------------------------------------------------------------------------
# Reading


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # MetricsLogger writes non-finite floats as "nan" / "inf"
        try:
            return float(value)
        except ValueError:
            return None
    return None


def load_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """One merged record per step, in step order.

    A step may be logged by several records (train metrics, then eval metrics) and again after a
    resume; later records win key by key, so both kinds survive and a resumed step replaces the
    values of the interrupted one. A line that is not JSON (a write cut off by a kill) is skipped
    with a note.
    """
    merged: dict[int, dict[str, Any]] = {}
    path = Path(run_dir) / "metrics.jsonl"
    with open(path) as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                print(f"note: {path}:{lineno}: not JSON (an interrupted write?), skipped")
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                merged.setdefault(record["step"], {}).update(record)
    return [merged[step] for step in sorted(merged)]


def series(records: list[dict[str, Any]], key: str) -> Series:
    steps, values = [], []
    for record in records:
        value = _number(record.get(key))
        if value is not None:
            steps.append(record["step"])
            values.append(value)
    return steps, values


# ------------------------------------------------------------------------------------------------
# Charts: each takes (records, axes factory) and returns None when drawn, or the missing metrics.


def _line(ax, data: Series, label: str, **kwargs) -> None:
    steps, values = data
    marker = "o" if len(steps) <= 30 else None
    ax.plot(steps, values, label=label, marker=marker, markersize=3, **kwargs)


def _band(ax, records, low_key: str, high_key: str, label: str, *, center: Optional[str] = None,
          halfwidth: Optional[str] = None, alpha: float = 0.2, color=None) -> bool:
    """Fill between two series, or around ``center`` +- ``halfwidth``, on the steps both have."""
    import numpy as np

    if center is not None:
        rows = [(r["step"], _number(r.get(center)), _number(r.get(halfwidth))) for r in records]
        rows = [(s, c - h, c + h) for s, c, h in rows if c is not None and h is not None]
    else:
        rows = [(r["step"], _number(r.get(low_key)), _number(r.get(high_key))) for r in records]
        rows = [row for row in rows if row[1] is not None and row[2] is not None]
    if not rows:
        return False
    steps, low, high = (np.array(column) for column in zip(*rows))
    ax.fill_between(steps, low, high, alpha=alpha, label=label, color=color, linewidth=0)
    return True


def chart_reward(records, fig) -> Optional[list[str]]:
    train, held_out, pass1 = (series(records, k) for k in (REWARD_MEAN, EVAL_REWARD, EVAL_PASS1))
    zero_std = series(records, ZERO_STD_FRAC)
    if not (train[0] or held_out[0] or pass1[0]):
        return [REWARD_MEAN, EVAL_REWARD, EVAL_PASS1]
    axes = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1]) if zero_std[0] else [fig.subplots()]
    ax = axes[0]
    if train[0]:
        _line(ax, train, "train mean")
        _band(ax, records, "", "", "train +- std", center=REWARD_MEAN, halfwidth=REWARD_STD)
    if held_out[0]:
        _line(ax, held_out, "held-out mean", linewidth=2)
    if pass1[0]:
        _line(ax, pass1, "held-out pass@1", linestyle="--")
    ax.set_ylabel("reward")
    ax.set_title("Reward")
    ax.legend(loc="best", fontsize=8)
    if zero_std[0]:
        _line(axes[1], zero_std, "zero-std groups", color="gray")
        axes[1].set_ylabel("zero-std\ngroups")
        axes[1].set_ylim(-0.02, 1.02)
    axes[-1].set_xlabel("step")
    return None


def chart_clip_fraction(records, fig) -> Optional[list[str]]:
    low, high = series(records, CLIP_LOW), series(records, CLIP_HIGH)
    if not (low[0] or high[0]):
        return [CLIP_LOW, CLIP_HIGH]
    ax = fig.subplots()
    if low[0]:
        _line(ax, low, "low side (s_i < 1 - eps_low, A < 0)")
    if high[0]:
        _line(ax, high, "high side (s_i > 1 + eps_high, A > 0)")
    ax.set(title="Sequence clip fraction", xlabel="step", ylabel="fraction of sequences")
    ax.legend(loc="best", fontsize=8)
    return None


def _histogram_values(records) -> list[tuple[int, list[float]]]:
    out = []
    for record in records:
        for key in LOG_RATIO_VALUES:
            values = record.get(key)
            if isinstance(values, list):
                numbers = [v for v in (_number(x) for x in values) if v is not None and math.isfinite(v)]
                if numbers:
                    out.append((record["step"], numbers))
                break
    return out


def chart_log_ratio(records, fig) -> Optional[list[str]]:
    mean = series(records, LOG_RATIO["mean"])
    histograms = _histogram_values(records)
    if not (mean[0] or histograms):
        return list(LOG_RATIO.values()) + [LOG_RATIO_VALUES[0]]
    axes = fig.subplots(1, 2, width_ratios=[3, 2]) if mean[0] and histograms else [fig.subplots()]
    if mean[0]:
        ax = axes[0]
        _band(ax, records, LOG_RATIO["min"], LOG_RATIO["max"], "min .. max", alpha=0.15,
              color="tab:blue")
        _band(ax, records, "", "", "mean +- std", center=LOG_RATIO["mean"],
              halfwidth=LOG_RATIO["std"], alpha=0.3, color="tab:blue")
        _line(ax, mean, "mean", color="tab:blue")
        ax.axhline(0.0, color="black", linewidth=0.5)
        ax.set(title="log s_i (sequence log-ratio)", xlabel="step", ylabel="log s_i")
        ax.legend(loc="best", fontsize=8)
    if histograms:
        import numpy as np

        ax = axes[-1]
        chosen = sorted({round(i * (len(histograms) - 1) / 3) for i in range(4)})
        all_values = np.concatenate([histograms[i][1] for i in chosen])
        low, high = float(all_values.min()), float(all_values.max())
        if high - low < 1e-12:
            low, high = low - 1e-6, high + 1e-6
        bins = np.linspace(low, high, 41)
        for i in chosen:
            step, values = histograms[i]
            ax.hist(values, bins=bins, histtype="step", linewidth=1.5, label=f"step {step}")
        ax.set(title="log s_i histogram", xlabel="log s_i", ylabel="sequences")
        ax.legend(loc="best", fontsize=8)
    return None


def chart_routing(records, fig) -> Optional[list[str]]:
    """All layers together, and each layer ``L`` from ``train/routing_change_frac_layer{L}``."""
    layers = sorted({int(m.group(1)) for r in records for k in r
                     if (m := ROUTING_CHANGE_LAYER.fullmatch(k))})
    overall, any_token = series(records, ROUTING_CHANGE), series(records, ROUTING_CHANGE_ANY)
    if not overall[0]:
        return [ROUTING_CHANGE]
    ax = fig.subplots()
    _line(ax, overall, "(token, layer) pairs", linewidth=2.5)
    if any_token[0]:
        _line(ax, any_token, "tokens, any layer", linewidth=2.5, linestyle="--")
    for layer in layers:
        _line(ax, series(records, f"train/routing_change_frac_layer{layer}"), f"layer {layer}",
              linewidth=1, alpha=0.6)
    ax.set(title="Routing change over the step's updates (top-k expert sets, response tokens)",
           xlabel="step", ylabel="fraction changed")
    ax.legend(loc="best", fontsize=8, ncol=2 if len(layers) > 6 else 1)
    return None


def _simple(title: str, ylabel: str, keys: list[tuple[str, str]], *, log_y: bool = False
            ) -> Callable:
    def chart(records, fig) -> Optional[list[str]]:
        data = [(series(records, key), label) for key, label in keys]
        if not any(d[0] for d, _ in data):
            return [key for key, _ in keys]
        ax = fig.subplots()
        for d, label in data:
            if d[0]:
                _line(ax, d, label)
        positive = all(v > 0 for d, _ in data for v in d[1])
        if log_y and positive:
            ax.set_yscale("log")
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if len(keys) > 1:
            ax.legend(loc="best", fontsize=8)
        return None
    return chart


CHARTS: dict[str, Callable] = {
    "reward.png": chart_reward,
    "clip_fraction.png": chart_clip_fraction,
    "log_ratio.png": chart_log_ratio,
    "response_length.png": _simple("Response length", "tokens",
                                   [(LENGTH_MEAN, "mean"), (LENGTH_MAX, "max")]),
    "entropy.png": _simple("Token entropy", "nats", [(ENTROPY, "mean")]),
    "mismatch.png": _simple("Rollout / trainer log-prob mismatch", "mean |delta log-prob|",
                            [(MISMATCH, "abs diff")], log_y=True),
    "routing.png": chart_routing,
    "log_ratio_var.png": _simple("Variance of the log importance ratios after the updates",
                                 "variance", [(TOKEN_LOG_RATIO_VAR, "log w_it over tokens"),
                                              (SEQ_LOG_RATIO_VAR, "log s_i over sequences")],
                                 log_y=True),
    "grad_norm.png": _simple("Gradient norm", "norm (before clipping)", [(GRAD_NORM, "grad norm")],
                             log_y=True),
    "throughput.png": _simple("Throughput", "tokens / s",
                              [(ROLLOUT_TPS, "rollout"), (TRAIN_TPS, "training")]),
    "loss.png": _simple("Loss", "loss", [(TRAIN_LOSS, "train"), (EVAL_LOSS, "held-out")]),
    # rollout.async (docs/async.md): how old the trained tokens are, and who waited for whom
    "staleness.png": _simple("Staleness of the trained tokens", "versions behind the trained policy",
                             [("train/staleness_mean", "mean"), ("train/staleness_max", "max")]),
    "idle.png": _simple("Idle fractions (measured)", "fraction of the step",
                        [("train/trainer_idle_frac", "trainer"),
                         ("train/rollout_idle_frac", "rollout")]),
    "weight_pause.png": _simple("Weight update: servers paused (pause -> continue)", "seconds",
                                [("sync/paused_s", "paused"), ("sync/seconds", "whole sync")]),
    # rollout.async full (pipeline/sources/stream.py): what happened to the groups, per step
    "stream.png": _simple("Rollout stream (async full): groups per step", "groups",
                          [("train/requeued", "re-queued"), ("train/resumed", "samples resumed"),
                           ("train/continued", "samples continued after a checkpoint"),
                           ("train/in_flight_groups", "in flight"),
                           ("train/buffered_groups", "buffered")]),
    # multi-turn, tool-using rollouts (docs/tools.md)
    "tool_calls.png": _simple("Tool calls per trajectory", "per trajectory",
                              [("train/tool_calls/mean", "tool calls"),
                               ("eval/tool_calls/mean", "tool calls (held-out)"),
                               ("train/tool_errors/mean", "tool errors"),
                               ("train/num_turns/mean", "model turns")]),
    "end_reasons.png": _simple("Why trajectories ended", "share of trajectories",
                               [(f"train/end_reason/{r}", r) for r in
                                ("done", "max_turns", "max_tokens", "tool_error", "abort")]),
    "behaviour_weight.png": _simple("Behaviour weight m_i (decoupled objective)", "value",
                                    [("train/mismatch_weight_mean", "mean"),
                                     ("train/mismatch_weight_max", "max"),
                                     ("train/mismatch_weight_ess", "effective sample size")]),
}


def plot_run(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Write every chart whose metrics exist; print a note for each one skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_records(run_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, chart in CHARTS.items():
        fig = plt.figure(figsize=(9, 5), layout="constrained")
        try:
            missing = chart(records, fig)
            if missing:
                print(f"note: {name} skipped: no {', '.join(missing)} in metrics.jsonl")
                continue
            for ax in fig.axes:
                ax.grid(True, alpha=0.3)
            fig.savefig(out / name, dpi=100)
            written.append(out / name)
        finally:
            plt.close(fig)
    return written
