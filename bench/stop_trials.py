"""Issue 38's acceptance check: SIGTERM to the launcher at a random moment of a short run, N times.

    PYTHONPATH=$PWD .venv/bin/python bench/stop_trials.py --trials 20 --seed 38

Each trial is a fresh 3-step run of ``launch/configs/tiny_cpu.yaml`` (2 ranks, EP2, one embedded
server behind the router, 4 prompts x 8 samples, ``run.save_interval=2``, ``run.eval_interval=2``
over 8 held-out prompts) in one of ``rollout.async`` off / one_step / full, and SIGTERM goes to
the launcher ``delay`` seconds after a phase of a step is entered on rank 0
(``bench/faults``): the rollout, the update or the weight sync of step 2 or 3, the evaluation of
step 2, the periodic save (step 2), the final save (step 3) or the final export. Phases and modes
are dealt from seeded shuffled decks (each comes up about equally often), delays uniform in
[0, --max-delay]; the seed and every trial's draw are printed first.

A trial passes when the fault fired and:

* the run exits 75, a checkpoint (no ``.tmp`` left) of step >= 1 exists, and ``--resume`` from
  it (no fault) says so, finishes with exit 0 and writes ``hf/``; or the run exits 0 with the
  final checkpoint (step 3) and ``hf/``;
* ``metrics.jsonl`` then holds steps 0 (the start's evaluation), 1, 2, 3 in order, each once;
* no run prints a traceback, and no process of the run is left once its launcher exited.

The table (trial, mode, phase, step, delay, whether the signal landed inside the phase, exit,
checkpoint step, the resumed run's exit, steps ok) and a final line with the pass count are
printed; the exit status is 1 if any trial failed. Measured: docs/faults.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bench.faults import ROOT, TAG_ENV, Fault, fired, tagged_pids

STEPS = 3
SETTINGS = ("run.global_batch_size=32", "run.micro_batch_size=8", "rollout.num_servers=1",
            "rollout.deterministic=true", f"run.num_steps={STEPS}", "run.save_interval=2",
            "run.eval_interval=2", "data.num_eval_prompts=8", "rollout.eval_samples_per_prompt=2")
MODES = ("off", "one_step", "full")
# (what the table calls it, the harness's phase, the steps it is drawn from)
PHASES = (("rollout", "rollout", (2, 3)), ("update", "update", (2, 3)), ("sync", "sync", (2, 3)),
          ("eval", "eval", (2,)), ("periodic save", "save", (2,)), ("final save", "save", (3,)),
          ("export", "export", (None,)))
RUN_TIMEOUT_S = 900


@dataclass
class Trial:
    index: int
    mode: str
    phase: str
    fault: Fault
    exit: Optional[int] = None
    inside: Optional[bool] = None
    checkpoint: Optional[int] = None
    resumed: Optional[int] = None
    steps_ok: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def deal(rng: random.Random, items: tuple, n: int) -> list:
    """``n`` items from shuffled copies of ``items``, one deck after another."""
    out: list = []
    while len(out) < n:
        deck = list(items)
        rng.shuffle(deck)
        out += deck
    return out[:n]


def draw(seed: int, n: int, max_delay: float) -> list[Trial]:
    rng = random.Random(seed)
    modes, phases = deal(rng, MODES, n), deal(rng, PHASES, n)
    trials = []
    for i in range(n):
        name, phase, steps = phases[i]
        fault = Fault("sigterm", phase, step=rng.choice(steps), delay_s=round(
            rng.uniform(0, max_delay), 2))
        trials.append(Trial(i + 1, modes[i], name, fault))
    return trials


def clean_env(**extra: str) -> dict:
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "SLURM_PROCID", "MEGATRON_GSPO_RANK_LOG_DIR",
            "MEGATRON_GSPO_STATUS_DIR", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("MGSPO_FAULT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, env.get("PYTHONPATH", "")
                                                                .split(os.pathsep))])
    return dict(env, **extra)


def run_train(run_dir: Path, mode: str, log: Path, *, env: dict, resume: bool) -> tuple[int, str, list]:
    """One ``megatron-gspo train``; returns (exit status, its output, pids left 15 s after)."""
    tag = uuid.uuid4().hex
    args = [sys.executable, "-m", "launch.cli", "train", "--config", "launch/configs/tiny_cpu.yaml",
            "--set", f"run.output_dir={run_dir}", "--set", f"rollout.async={mode}"]
    for item in SETTINGS:
        args += ["--set", item]
    args += ["--resume"] if resume else []
    with open(log, "w") as out:
        proc = subprocess.Popen(args, cwd=ROOT, env=dict(env, **{TAG_ENV: tag}), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = -999
    deadline = time.monotonic() + 15
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return code, log.read_text(), left


def metric_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line)["step"] for line in lines if line.strip()]


def latest_step(run_dir: Path) -> Optional[int]:
    marker = run_dir / "checkpoints" / "latest"
    return int(marker.read_text().strip().split("_")[1]) if marker.is_file() else None


def run_trial(trial: Trial, work: Path) -> None:
    run_dir, problems = work / f"trial{trial.index:02d}", trial.problems
    log = work / f"trial{trial.index:02d}.fault.jsonl"
    code, out, left = run_train(run_dir, trial.mode, work / f"trial{trial.index:02d}.log",
                                env=trial.fault.env(clean_env(), log=log), resume=False)
    trial.exit, records = code, fired(log)
    trial.checkpoint = latest_step(run_dir)
    if not records or "error" in records[0]:
        problems.append(f"the fault did not fire: {records}")
    else:
        trial.inside = records[0]["inside"]
    if left:
        problems.append(f"processes left: {left}")
    if "Traceback" in out:
        problems.append("a traceback on the console")
    tmp = [p.name for p in (run_dir / "checkpoints").glob("*.tmp")]
    if tmp:
        problems.append(f"partial checkpoints: {tmp}")
    if code == 75:
        if trial.checkpoint is None or trial.checkpoint < 1:
            problems.append("exit 75 without a checkpoint")
        code2, out2, left2 = run_train(run_dir, trial.mode, work / f"trial{trial.index:02d}"
                                       ".resume.log", env=clean_env(), resume=True)
        trial.resumed = code2
        if code2 != 0:
            problems.append(f"the resumed run exited {code2}")
        if f"(step {trial.checkpoint})" not in out2:
            problems.append(f"the resumed run did not say it resumed from step {trial.checkpoint}")
        if left2 or "Traceback" in out2:
            problems.append("the resumed run left processes or printed a traceback")
    elif code == 0:
        if trial.checkpoint != STEPS:
            problems.append(f"exit 0 but the newest checkpoint is {trial.checkpoint}")
    else:
        problems.append(f"exit {code}")
    if not (run_dir / "hf" / "model.safetensors.index.json").is_file():
        problems.append("no hf/ at the end")
    steps = metric_steps(run_dir)
    trial.steps_ok = steps == list(range(0, STEPS + 1))  # step 0: the fresh run's evaluation
    if not trial.steps_ok:
        problems.append(f"metrics.jsonl steps {steps}")


def row(t: Trial) -> str:
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    return (f"| {t.index:>2} | {t.mode:<8} | {t.phase:<13} | {fmt(t.fault.step):>4} | "
            f"{t.fault.delay_s:>5.2f} | {fmt(t.inside):<6} | {fmt(t.exit):>4} | "
            f"{fmt(t.checkpoint):>4} | {fmt(t.resumed):>7} | {'yes' if t.steps_ok else 'NO':<8} | "
            f"{'pass' if t.ok else 'FAIL'} |")


HEADER = ("| #  | mode     | phase         | step | delay | inside | exit | ckpt | resumed | "
          "steps ok | ok   |\n|----|----------|---------------|------|-------|--------|------|"
          "------|---------|----------|------|")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=38)
    p.add_argument("--max-delay", type=float, default=1.5,
                   help="the signal comes uniform(0, this) seconds into the phase")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep the run directories and logs here (default: a temporary dir, removed)")
    p.add_argument("--only", type=int, nargs="*", default=None,
                   help="run only these trials of the draw (numbers from 1)")
    args = p.parse_args(argv)
    trials = draw(args.seed, args.trials, args.max_delay)
    if args.only:
        trials = [t for t in trials if t.index in args.only]
    print(f"seed {args.seed}, {args.trials} trials, delays uniform in [0, {args.max_delay}] s:",
          flush=True)
    for t in trials:
        print(f"  trial {t.index:>2}: rollout.async={t.mode:<8} {t.phase:<13} {t.fault}", flush=True)
    work = args.keep or Path(tempfile.mkdtemp(prefix="stop_trials_"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        for t in trials:
            t0 = time.monotonic()
            run_trial(t, work)
            print(row(t) + f" {time.monotonic() - t0:.0f}s" + (
                "" if t.ok else "  " + "; ".join(t.problems)), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + HEADER)
    for t in trials:
        print(row(t))
    passed = sum(t.ok for t in trials)
    print(f"\n{passed}/{len(trials)} trials passed ({sum(t.exit == 75 for t in trials)} exit 75 "
          f"then resumed, {sum(t.exit == 0 for t in trials)} exit 0; "
          f"{sum(bool(t.inside) for t in trials)} signals inside their phase) in "
          f"{(time.monotonic() - start) / 60:.1f} min", flush=True)
    for t in trials:
        if not t.ok:
            print(f"trial {t.index} FAILED: " + "; ".join(t.problems), flush=True)
    return 0 if passed == len(trials) else 1


if __name__ == "__main__":
    sys.exit(main())
