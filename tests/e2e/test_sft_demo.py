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


def test_sft_from_a_jsonl_file_and_a_malformed_row(tmp_path):
    import random

    rng = random.Random(0)
    rows = []
    for _ in range(200):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        rows.append(json.dumps({"question": {"text": f"{a}*{b}="}, "response": str(a * b)}))
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(rows) + "\n")
    common = ["--set", "data.task=null", "--set", f"data.train_path={train}",
              "--set", "data.prompt_key=question.text", "--set", "data.label_key=response",
              "--set", "parallel.expert=1", "--set", "run.num_steps=15", "--set", "run.eval_interval=0",
              "--set", "run.log_interval=5", "--set", "reward.kind=exact_match", "--nproc", "1"]
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "sft", "--config",
                           "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={run_dir}",
                           *common], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    train_losses = [json.loads(line)["train/loss"] for line in
                    (run_dir / "metrics.jsonl").read_text().splitlines()
                    if "train/loss" in line]
    assert len(train_losses) == 15 and train_losses[-1] < 0.7 * train_losses[0]
    # a malformed row stops the run with its file and line
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows[:3] + ['{"question": {"text": "1*1="}}'] + rows[3:10]) + "\n")
    proc = subprocess.run([sys.executable, "-m", "launch.cli", "sft", "--config",
                           "launch/configs/tiny_cpu_sft.yaml", "--set", f"run.output_dir={tmp_path / 'bad'}",
                           *[c if c != f"data.train_path={train}" else f"data.train_path={bad}"
                             for c in common]],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode != 0
    assert f"{bad}:4" in proc.stderr and "response" in proc.stderr


def test_sft_checkpoints_and_resume_from_the_command_line(tmp_path):
    run_dir = tmp_path / "run"
    base = [sys.executable, "-m", "launch.cli", "sft", "--config", "launch/configs/tiny_cpu_sft.yaml",
            "--nproc", "1", "--set", "parallel.expert=1", "--set", f"run.output_dir={run_dir}",
            "--set", "run.eval_interval=0", "--set", "run.save_interval=2",
            "--set", "data.num_eval_prompts=4"]

    def sft(*extra):
        return subprocess.run([*base, *extra], cwd=ROOT, capture_output=True, text=True, timeout=400)

    proc = sft("--set", "run.num_steps=3")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000003"
    assert (run_dir / "checkpoints" / "step_000002").is_dir()
    # the same directory again without --resume: refused, naming the field and the fix
    proc = sft("--set", "run.num_steps=5")
    assert proc.returncode == 2
    assert "run.output_dir" in proc.stderr and "pass --resume" in proc.stderr
    proc = sft("--set", "run.num_steps=5", "--resume")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "(step 3)" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2, 3, 4, 5]
    assert all(r["train/lr"] == 3e-3 for r in records if "train/loss" in r)  # constant schedule
