"""Fault injection for whole runs: a fault at a chosen phase of a chosen step, from the test side.

    fault = Fault("sigterm", "sync", step=2, delay_s=0.3)
    env = fault.env(os.environ, log=run_dir.parent / "fault.jsonl")
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "train", ...], env=env)
    ...
    fired(run_dir.parent / "fault.jsonl")   # [{"action", "phase", "step", "inside", ...}]

Faults (``ACTIONS``): ``sigterm`` to the launcher (what Slurm, systemd and ``timeout`` send),
SIGKILL of a rollout server (``kill-server``: a ``python -m pipeline.local`` below rank 0), of
the router (``kill-router``: ``sglang_router``) or of the training rank itself (``kill-rank``).
Phases (``PHASES``) and the function whose entry starts the fault's clock:

    rollout  pipeline.step.loop.HeldBackRoutes.next_batch  (rank 0: the step's batch, by source)
    update   RLTrainer.train_rollout                       (every rank)
    sync     pipeline.step.loop.sync_weights               (every rank; step 0: the first sync)
    eval     pipeline.step.loop.evaluate                   (rank 0; step 0: a fresh run's start)
    save     CheckpointedTrainer.save                      (every rank; periodic, final, on a stop)
    export   launch.rl_session.export_hf_dir into hf/      (every rank; the final policy)

The fault fires ``delay_s`` after the phase of ``step`` is entered on rank ``rank`` (default 0;
rollout and eval run on rank 0 only), from a thread, so it lands inside the phase when the phase
lasts longer than the delay (each record's ``inside`` says whether it did). How: the run's
``PYTHONPATH`` starts with ``bench/faults/site``, whose ``sitecustomize`` installs
:mod:`bench.faults.inject` where ``MGSPO_FAULT`` is set (an import hook patches the phase's
function when its module is imported); without it, and in every process but the launcher and
the chosen rank, nothing changes. No production module knows about any of this.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from bench.faults.inject import (ACTIONS, DELAY_ENV, FAULT_ENV, LAUNCHER_ENV, LOG_ENV, PHASES,
                                 RANK_ENV, parse)

__all__ = ["ACTIONS", "PHASES", "Fault", "fired", "SITE_DIR", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]
SITE_DIR = Path(__file__).resolve().parent / "site"
"""Goes first on the run's PYTHONPATH: its ``sitecustomize`` loads the harness."""


@dataclass(frozen=True)
class Fault:
    action: str
    """One of :data:`ACTIONS`."""
    phase: str
    """One of :data:`PHASES`."""
    step: Optional[int] = None
    """The step whose phase fires it (None: the phase's first entry; ignored by ``export``)."""
    delay_s: float = 0.0
    rank: int = 0

    def __post_init__(self) -> None:
        parse(self.spec)  # ValueError naming what is wrong

    @property
    def spec(self) -> str:
        where = self.phase if self.step is None or self.phase == "export" else \
            f"{self.phase}:{self.step}"
        return f"{self.action}@{where}"

    def env(self, base: Mapping[str, str], *, log: Path) -> dict:
        """``base`` with this fault: the harness's ``PYTHONPATH`` (site dir, then the repository
        root, then ``base``'s) and its variables; the fault's records are appended to ``log``."""
        env = {k: v for k, v in base.items() if k != LAUNCHER_ENV}
        path = [str(SITE_DIR), str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                             if p]
        env.update({"PYTHONPATH": os.pathsep.join(path), FAULT_ENV: self.spec,
                    DELAY_ENV: str(self.delay_s), RANK_ENV: str(self.rank), LOG_ENV: str(log)})
        return env

    def __str__(self) -> str:
        return f"{self.spec} +{self.delay_s:.2f}s" + (f" rank {self.rank}" if self.rank else "")


def fired(log: Path) -> list[dict]:
    """The records of the faults that fired (one JSON object per line of ``log``)."""
    if not Path(log).is_file():
        return []
    return [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]


TAG_ENV = "RELIABILITY_TAG"
"""Set to a run's own tag in the environment of the run's processes: every process it starts
inherits it, so the run's processes can be found (and killed) whatever their parents."""


def tagged_pids(tag: str) -> list[int]:
    """Every live process whose environment holds ``TAG_ENV=tag`` (zombies excluded)."""
    needle = f"{TAG_ENV}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found
