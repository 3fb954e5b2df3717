"""The pure parts of bench/bench_stability.py: collapse definition, lr choice, summary, table."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "bench_stability.py"
_spec = importlib.util.spec_from_file_location("bench_stability", _PATH)
bs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)


def test_arms_cover_the_registry_variants():
    from megatron_gspo.loss.variants import VARIANTS

    assert {variant for variant, _ in bs.ARMS.values()} == set(VARIANTS)
    assert bs.ARMS["grpo_replay_old"] == ("grpo", "old")
    assert bs.ARMS["grpo_replay_rollout"] == ("grpo", "rollout")


def test_no_collapse_when_reward_stays_up():
    assert bs.find_collapse([0.2, 0.3, 0.4, 0.35, 0.4, 0.38]) is None


def test_collapse_needs_patience_consecutive_steps():
    kw = dict(frac=0.5, patience=3, window=1, floor=0.05)
    # falls below half of the max 0.6 at index 2, 3, 4: collapse starts at 2
    assert bs.find_collapse([0.4, 0.6, 0.2, 0.1, 0.1, 0.5], **kw) == 2
    # two low steps, then a recovery: not a collapse
    assert bs.find_collapse([0.4, 0.6, 0.2, 0.1, 0.5, 0.5], **kw) is None


def test_collapse_uses_the_trailing_mean():
    # window 3: one bad step is averaged away
    assert bs.find_collapse([0.6, 0.6, 0.6, 0.0, 0.6, 0.6, 0.6], frac=0.5, patience=1,
                            window=3, floor=0.05) is None
    assert bs.find_collapse([0.6, 0.6, 0.6, 0.0, 0.6, 0.6, 0.6], frac=0.5, patience=1,
                            window=1, floor=0.05) == 3


def test_no_collapse_below_the_floor():
    assert bs.find_collapse([0.04, 0.0, 0.0, 0.0, 0.0], floor=0.05, window=1) is None
    assert bs.find_collapse([0.06, 0.0, 0.0, 0.0, 0.0], floor=0.05, window=1) == 1


def test_choose_lr_best_then_smaller():
    assert bs.choose_lr({1e-4: 0.2, 3e-4: 0.5, 1e-3: 0.1}) == 3e-4
    assert bs.choose_lr({1e-4: 0.5, 3e-4: 0.5, 1e-3: 0.1}) == 1e-4


def test_mean_std():
    assert bs.mean_std([1.0]) == (1.0, 0.0)
    mean, std = bs.mean_std([1.0, 2.0, 3.0])
    assert mean == 2.0 and std == pytest.approx(1.0)
    assert all(math.isnan(x) for x in bs.mean_std([]))


def _records(variant_clip: str):
    recs = [{"step": 0, "eval/reward_mean": 0.2}]
    for step, reward in enumerate([0.3, 0.4, 0.5], start=1):
        r = {"step": step, "train/reward_mean": reward, "train/routing_change_frac": 0.1 * step,
             "train/routing_change_any_frac": 0.2, "train/token_log_ratio_var": 1e-4,
             "train/seq_log_ratio_var": 1e-6}
        if variant_clip == "sequence":
            r.update({"train/clip_frac_low": 0.1, "train/clip_frac_high": 0.05})
        else:
            r.update({"train/token_clip_frac_low": 0.01, "train/token_clip_frac_high": 0.02})
        recs.append(r)
    recs[-1]["eval/reward_mean"] = 0.45
    return recs


@pytest.mark.parametrize("unit", ["sequence", "token"])
def test_summarize(unit):
    s = bs.summarize(_records(unit))
    assert s["steps"] == 3
    assert s["eval_start"] == 0.2 and s["eval_final"] == 0.45
    assert s["eval_delta"] == pytest.approx(0.25)
    assert s["eval_curve"] == [(0, 0.2), (3, 0.45)]
    assert s["clip_unit"] == unit
    assert s["clip_frac"] == pytest.approx(0.15 if unit == "sequence" else 0.03)
    assert s["routing_change_frac"] == pytest.approx(0.2)
    assert not s["collapsed"] and s["collapse_step"] is None
    assert s["series"]["step"] == [1, 2, 3]


def test_summarize_collapse_reports_the_step_number():
    recs = [{"step": i + 1, "train/reward_mean": r}
            for i, r in enumerate([0.5, 0.6, 0.1, 0.1, 0.1, 0.1])]
    s = bs.summarize(recs, collapse_kw=dict(window=1, patience=3, frac=0.5, floor=0.05))
    assert s["collapsed"] and s["collapse_step"] == 3


def test_table_rows_mean_over_seeds():
    runs = {}
    for seed, final in ((1, 0.4), (2, 0.6)):
        r = bs.summarize(_records("sequence"))
        r.update(eval_final=final, eval_delta=final - 0.2, seconds=10.0)
        runs[bs.run_key("gspo", 4, 3e-4, seed)] = r
    results = {"runs": runs, "cells": {"gspo/k4": {"lr": 3e-4, "runs": list(runs)}}}
    table = bs.make_table(results, ["gspo", "grpo"], [4])
    lines = table.strip().splitlines()
    assert len(lines) == 3  # header, separator, one row (grpo has no cell)
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|")
    assert "| gspo | 4 | 0.0003 | 2 |" in lines[2]
    assert "0.500 +- 0.141" in lines[2]
    assert "0 / 0 of 2" in lines[2]


def test_lengths_fit_the_carry_task():
    from pipeline.scoring.tasks import CarryAdditionTask

    args = bs.parse_args(["--task", "carry_addition", "--digits", "4"])
    new, seq = bs.lengths(args)
    task = CarryAdditionTask(digits=4)
    for p in task.problems(0, 200) + task.problems(0, 50, split="eval"):
        assert len(p.answer_ids) <= new
        assert len(p.prompt_ids) + new <= seq


def test_smoke_preset():
    args = bs.parse_args(["--smoke"])
    assert args.arms == "gspo,grpo" and args.ks == "1,2" and args.seeds == 1
    assert len(args.lrs.split(",")) == 1 and args.task == "addition"
    with pytest.raises(SystemExit):
        bs.parse_args(["--arms", "nope"])


def test_smoke_preset_yields_to_explicit_flags():
    args = bs.parse_args(["--smoke", "--arms", "grpo_replay_old", "--ks", "2"])
    assert args.arms == "grpo_replay_old" and args.ks == "2" and args.steps == 3


def test_held_out_collapse():
    assert bs.held_out_collapsed([(0, 0.4), (10, 0.5), (20, 0.2)])
    assert not bs.held_out_collapsed([(0, 0.4), (10, 0.5), (20, 0.3)])
    assert bs.held_out_collapsed([(0, 0.6), (10, 0.25), (20, 0.5)])  # a dip that recovers counts
    assert not bs.held_out_collapsed([(0, 0.2)])
    assert not bs.held_out_collapsed([(0, 0.04), (20, 0.0)])  # below the floor
    assert not bs.held_out_collapsed([])


# ------------------------------------------------------------------------------------------------
# the orchestration of main(): lr tuning per arm at --tune-k, then the reported runs seed-major


def _sft_dir(tmp_path: Path, **changes) -> Path:
    args = bs.parse_args([])
    config = {name: getattr(args, flag) for name, flag in bs._SFT_FIELDS.items()}
    config.update(changes)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(__import__("json").dumps(config))
    return hf


def test_sft_from_must_match_the_model_flags(tmp_path):
    hf = _sft_dir(tmp_path, num_experts=8)
    with pytest.raises(SystemExit, match="num_experts = 8 but --experts 16"):
        bs.main(["--out", str(tmp_path / "out"), "--sft-from", str(hf), "--only-sft"])
    with pytest.raises(SystemExit, match="no config.json"):
        bs.main(["--out", str(tmp_path / "out"), "--sft-from", str(tmp_path), "--only-sft"])


def _fake_result(final: float) -> dict:
    r = bs.summarize(_records("sequence"))
    r.update(eval_final=final, eval_delta=final - 0.2, seconds=1.0)
    return r


def test_main_tunes_each_arm_once_then_runs_seed_major(tmp_path, monkeypatch):
    hf = _sft_dir(tmp_path)
    best = {"gspo": 1e-4, "grpo": 3e-4}
    calls = []

    def fake_train_one(args, out, sft_hf, arm, k, lr, seed):
        assert sft_hf == hf
        calls.append((arm, k, lr, seed))
        return _fake_result(0.5 if lr == best[arm] else 0.3)

    monkeypatch.setattr(bs, "train_one", fake_train_one)
    monkeypatch.setattr(bs, "plot", lambda *a, **kw: [])
    monkeypatch.setattr(bs, "plot_summary", lambda *a, **kw: tmp_path / "none.png")
    out = tmp_path / "out"
    assert bs.main(["--out", str(out), "--sft-from", str(hf), "--arms", "gspo,grpo", "--ks", "1,8",
                    "--lrs", "1e-4,3e-4", "--seeds", "2", "--tune-k", "4"]) == 0
    tuning = [(a, 4, lr, 0) for a in ("gspo", "grpo") for lr in (1e-4, 3e-4)]
    reported = [(a, k, best[a], s) for s in (1, 2) for k in (1, 8) for a in ("gspo", "grpo")]
    assert calls == tuning + reported
    results = __import__("json").loads((out / "results.json").read_text())
    assert results["chosen_lr"] == best
    assert results["cells"]["grpo/k8"] == {
        "lr": 3e-4, "runs": [bs.run_key("grpo", 8, 3e-4, s) for s in (1, 2)]}
    table = (out / "table.md").read_text()
    assert "| gspo | 0.500 | 0.300 | 0.0001 |" in table
    assert "| grpo | 0.300 | 0.500 | 0.0003 |" in table
    assert "reported runs done: 8 of 8" in table


def test_report_only_reads_finished_runs_and_trains_nothing(tmp_path, monkeypatch):
    import json

    out = tmp_path / "out"
    for key, final in ((bs.run_key("gspo", 4, 1e-4, 0), 0.4), (bs.run_key("gspo", 4, 3e-4, 0), 0.6),
                       (bs.run_key("gspo", 1, 3e-4, 1), 0.7)):
        (out / "runs" / key).mkdir(parents=True)
        (out / "runs" / key / "result.json").write_text(json.dumps(_fake_result(final)))

    def no_training(*a, **kw):
        raise AssertionError("--report-only started a run")

    monkeypatch.setattr(bs, "run_cli", no_training)
    monkeypatch.setattr(bs, "plot", lambda *a, **kw: [])
    monkeypatch.setattr(bs, "plot_summary", lambda *a, **kw: tmp_path / "none.png")
    assert bs.main(["--out", str(out), "--report-only", "--arms", "gspo,grpo", "--ks", "1,8",
                    "--lrs", "1e-4,3e-4", "--seeds", "2"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["chosen_lr"] == {"gspo": 3e-4, "grpo": None}  # grpo's tuning has not run
    assert results["cells"]["gspo/k1"]["runs"] == [bs.run_key("gspo", 1, 3e-4, 1)]
    table = (out / "table.md").read_text()
    assert "| gspo | 1 | 0.0003 | 1 | " in table
    assert "reported runs done: 1 of 8" in table


def test_plots_are_written_from_results(tmp_path):
    runs, cells = {}, {}
    for arm, unit in (("gspo", "sequence"), ("grpo", "token")):
        for k in (1, 4):
            keys = []
            for seed in (1, 2):
                r = bs.summarize(_records(unit))
                r.update(seconds=1.0, eval_final=0.4 + 0.1 * seed)
                runs[bs.run_key(arm, k, 1e-4, seed)] = r
                keys.append(bs.run_key(arm, k, 1e-4, seed))
            cells[f"{arm}/k{k}"] = {"lr": 1e-4, "runs": keys}
    results = {"runs": runs, "cells": cells}
    paths = bs.plot(results, ["gspo", "grpo"], [1, 4], tmp_path)
    paths.append(bs.plot_summary(results, ["gspo", "grpo"], [1, 4], tmp_path))
    assert [p.name for p in paths] == ["stability_k1.png", "stability_k4.png", "stability_summary.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
