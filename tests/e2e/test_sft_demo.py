"""The SFT demo end to end: two local ranks (EP2) started by the CLI, loss falling, metrics files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_sft_demo_two_ranks_loss_falls(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "sft", "--config", "launch/configs/tiny_cpu_sft.yaml",
         "--set", "run.num_steps=25", "--set", f"run.output_dir={run_dir}",
         "--set", "run.eval_interval=0", "--set", "run.log_interval=5"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "starting 2 local ranks" in proc.stdout
    assert "expert 2" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r["train/loss"] for r in records if "train/loss" in r]
    evals = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 26))
    assert train[-1] < 0.6 * train[0]
    assert len(evals) == 2 and evals[1] < 0.6 * evals[0]
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("held-out loss: ")
    assert (run_dir / "hf" / "config.json").is_file() and (run_dir / "hf" / "tokenizer.json").is_file()
