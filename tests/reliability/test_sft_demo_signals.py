"""Issue 11, the signal story for ``sft`` and ``demo`` (the commands besides ``train``).

Before the fix ``megatron-gspo sft`` installed no stop handler: SIGTERM to the launcher was passed
on to torchrun and the ranks, which died of it (exit 143, no checkpoint: the steps since the last
periodic save were lost). ``megatron-gspo demo`` ran its stages with ``subprocess.call``: SIGTERM
killed the demo alone while the SFT (or GSPO) ranks trained on in the background.

* ``sft`` (2 local ranks under the launcher and torchrun, checkpoints only on the signal:
  ``run.save_interval=0``): SIGTERM to the launcher saves the step the ranks were on, exits 75 and
  writes no ``hf``; ``sft --resume`` continues right after it, and its losses and gradient norms
  equal an uninterrupted run's, step for step.
* ``demo``: SIGTERM while its SFT stage trains reaches that stage, which checkpoints and exits 75;
  the demo exits 75 too, starts no GSPO stage and leaves no process behind.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.reliability.conftest import SFT_CONFIG, Run, latest_step, megatron_gspo, metric_steps

pytestmark = pytest.mark.slow
STEPS = 16
SFT_SETTINGS = (f"run.num_steps={STEPS}", "run.eval_interval=0", "run.log_interval=1",
                "run.save_interval=0")


def sft_args(run_dir: Path) -> list[str]:
    args = ["sft", "--config", SFT_CONFIG, "--set", f"run.output_dir={run_dir}", "--nproc", "2"]
    for item in SFT_SETTINGS:
        args += ["--set", item]
    return args


def records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "train/loss" in r}


def trained_steps(run_dir: Path) -> list[int]:
    """The step of every line of metrics.jsonl with a training loss, in file order (step 0, the
    held-out loss before training, has none; a repeated step shows twice)."""
    if not (run_dir / "metrics.jsonl").exists():
        return []
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "train/loss" in r]


@pytest.mark.extended  # the README suite's time; .ci/run runs it after the suite
def test_sft_sigterm_checkpoints_exits_75_and_resumes_exactly(tmp_path):
    run_dir = tmp_path / "sft"
    run = Run(sft_args(run_dir), tmp_path / "first.log")
    try:
        run.wait_until(lambda: len(trained_steps(run_dir)) >= 3, "3 SFT steps")
        logged = len(trained_steps(run_dir))
        code, left = run.stopped_by(lambda: run.proc.send_signal(signal.SIGTERM))
    finally:
        run.kill_everything()
    out = run.output()
    assert code == 75, f"sft exited {code}:\n{out[-5000:]}"
    assert left == [], f"processes left behind: {left}"
    assert "preempted: checkpoint saved; exit 75" in out and "Traceback" not in out, out[-5000:]
    saved = latest_step(run_dir)
    # the checkpoint holds the last step logged (the one in progress when the signal came, or a
    # later one finished before every rank saw it); nothing else was saved (save_interval 0)
    assert saved >= logged and trained_steps(run_dir) == list(range(1, saved + 1)), \
        (saved, logged, trained_steps(run_dir))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        ["latest", f"step_{saved:06d}"]
    assert saved < STEPS and not (run_dir / "hf").exists()

    resumed = megatron_gspo(*sft_args(run_dir), "--resume", timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"(step {saved})" in resumed.stdout
    assert metric_steps(run_dir) == list(range(0, STEPS + 1))  # each step once
    assert (run_dir / "hf" / "config.json").is_file()

    reference_dir = tmp_path / "reference"
    reference = megatron_gspo(*sft_args(reference_dir), timeout=600)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    got, want = records(run_dir), records(reference_dir)
    for step in range(1, STEPS + 1):  # bit for bit: the interrupted run is the uninterrupted one
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


def test_demo_passes_sigterm_to_its_stage_and_exits_75(tmp_path):
    out_dir = tmp_path / "demo"
    run = Run(["demo", "--out", str(out_dir)], tmp_path / "demo.log")  # SFT: 700 steps
    sft_dir = out_dir / "sft"
    try:
        run.wait_until(lambda: len(trained_steps(sft_dir)) >= 2, "2 steps of the demo's SFT")
        code, left = run.stopped_by(lambda: run.proc.send_signal(signal.SIGTERM))
    finally:
        run.kill_everything()
    out = run.output()
    assert code == 75, f"demo exited {code}:\n{out[-5000:]}"
    assert left == [], f"processes left behind: {left}"
    assert "megatron-gspo demo: stopped by SIGTERM during megatron-gspo sft (checkpoint saved); " \
           "exit 75" in out, out[-3000:]
    assert "+ megatron-gspo train" not in out and not (out_dir / "gspo").exists()
    saved = latest_step(sft_dir)
    assert saved >= 2 and trained_steps(sft_dir) == list(range(1, saved + 1))
