"""bench/compare_runs.py: the refactor check (same deterministic run before and after) finds a
changed metric or weight, and only those."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from bench.compare_runs import main


def _run(path, *, reward=0.5, step_s=1.0, weight=1.0):
    (path / "hf").mkdir(parents=True)
    rows = [{"step": 1, "train/reward_mean": reward, "train/step_s": step_s},
            {"step": 2, "train/reward_mean": 0.75, "sync/seconds": step_s * 2}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"w": torch.full((2, 2), weight)}, str(path / "hf" / "model.safetensors"))
    return str(path)


def test_equal_runs_pass_whatever_their_timings(tmp_path, capsys):
    assert main([_run(tmp_path / "a"), _run(tmp_path / "b", step_s=9.0)]) == 0
    assert "4 values compared, 0 differ" in capsys.readouterr().out


def test_a_changed_metric_or_weight_is_named(tmp_path, capsys):
    a = _run(tmp_path / "a")
    assert main([a, _run(tmp_path / "b", reward=0.5000001)]) == 1
    assert "step 1: train/reward_mean 0.5 != 0.5000001" in capsys.readouterr().out
    assert main([a, _run(tmp_path / "c", weight=1.0 + 2 ** -20)]) == 1
    assert "w: differs" in capsys.readouterr().out
