"""``megatron-gspo plot``: PNGs from a synthetic metrics.jsonl, notes for absent metrics."""

from __future__ import annotations

import json
import math
import random

from launch.cli import main
from launch.plot import CHARTS, load_records

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, steps: int = 12, *, eval_every: int = 4):
    rng = random.Random(0)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            values = [rng.gauss(0.0, 2e-4 * step) for _ in range(64)]
            record = {
                "step": step, "time_s": step * 1.5,
                "train/reward_mean": 0.2 + 0.05 * step, "train/reward_std": 0.3,
                "train/zero_std_group_frac": max(0.0, 0.5 - 0.04 * step),
                "train/response_length_mean": 6 + 0.1 * step, "train/response_length_max": 9,
                "train/log_ratio_seq_mean": sum(values) / len(values),
                "train/log_ratio_seq_std": 2e-4 * step,
                "train/log_ratio_seq_min": min(values), "train/log_ratio_seq_max": max(values),
                "train/log_ratio_seq_values": values,
                "train/clip_frac_low": 0.01 * step, "train/clip_frac_high": 0.02 * step,
                "train/entropy_mean": 1.5 - 0.05 * step,
                "train/grad_norm": 0.5 + rng.random(),
                "train/rollout_trainer_logprob_abs_diff": 1e-3 * (1 + rng.random()),
                "train/rollout_tokens_per_s": 900.0, "train/train_tokens_per_s": 400.0,
                "train/routing_change_frac": 0.1 / step, "train/routing_change_any_frac": 0.3 / step,
                "train/routing_change_frac_layer0": 0.05 / step,
                "train/routing_change_frac_layer1": 0.15 / step,
                "train/token_log_ratio_var": 1e-3 * step, "train/seq_log_ratio_var": 1e-4 * step,
                "train/staleness_mean": float(step > 1), "train/staleness_max": float(step > 1),
                "train/trainer_idle_frac": 0.1, "train/rollout_idle_frac": 0.2,
                "train/mismatch_weight_mean": 1.0, "train/mismatch_weight_max": 1.2,
                "train/mismatch_weight_ess": 0.99,
                "sync/paused_s": 0.1, "sync/seconds": 0.12,
                "train/requeued": float(step % 3 == 0), "train/resumed": 2.0,
                "train/in_flight_groups": 4.0, "train/buffered_groups": 1.0,
                "train/tool_calls/mean": 1.0 + 0.02 * step, "train/tool_errors/mean": 0.1,
                "train/num_turns/mean": 2.0, "train/end_reason/done": 0.9,
                "train/end_reason/max_tokens": 0.1, "train/end_reason/max_turns": 0.0,
                "train/end_reason/tool_error": 0.0, "train/end_reason/abort": 0.0,
            }
            if step == 3:
                record["train/entropy_mean"] = "nan"  # MetricsLogger writes non-finite as strings
            f.write(json.dumps(record) + "\n")
            if step % eval_every == 0:  # held-out metrics in their own record of the same step
                f.write(json.dumps({"step": step, "eval/reward_mean": 0.1 * step / 4,
                                    "eval/pass_at_1": 0.08 * step / 4,
                                    "eval/tool_calls/mean": 1.0}) + "\n")
        f.write('{"step": 13, "train/rew')  # a write cut off by a kill


def test_plot_writes_valid_pngs(tmp_path, capsys):
    run = tmp_path / "run"
    _write_run(run)
    out = tmp_path / "plots"
    assert main(["plot", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    expected = set(CHARTS) - {"loss.png"}  # no train/loss in an RL run
    assert {p.name for p in out.glob("*.png")} == expected
    for name in expected:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, name
    assert "note: loss.png skipped: no train/loss, eval/loss in metrics.jsonl" in printed
    assert "metrics.jsonl:16: not JSON" in printed

    records = load_records(run)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records[3]["eval/reward_mean"] == 0.1 and records[3]["train/reward_mean"] == 0.4
    assert math.isnan(float(records[2]["train/entropy_mean"]))


def test_plot_skips_absent_metrics_and_defaults_to_run_plots(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "train/reward_mean": s / 10}) + "\n" for s in range(3)))
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in (run / "plots").glob("*.png")) == ["reward.png"]
    assert "note: clip_fraction.png skipped: no train/clip_frac_low, train/clip_frac_high" in printed
    assert "note: mismatch.png skipped: no train/rollout_trainer_logprob_abs_diff" in printed


def test_plot_without_metrics(tmp_path, capsys):
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "metrics.jsonl not found" in capsys.readouterr().out
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "other": 2}\n')
    assert main(["plot", str(tmp_path)]) == 1
    assert "no known metrics" in capsys.readouterr().out
