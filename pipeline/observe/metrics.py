"""Run metrics a person can read and plot: one JSON object per step in ``metrics.jsonl``, the same
scalars in TensorBoard (``tb/``), and a one-line progress report per step on stdout; and, as
``run.loggers`` lists them, in Weights & Biases and MLflow (``pipeline.observe.trackers``: they get a step
once it is covered by a checkpoint, :meth:`MetricsLogger.commit`). docs/metrics.md names every
metric.

Only one process (global rank 0) writes; the others get a logger whose methods do nothing.

Each step is logged exactly once, across restarts: a run resumed from the checkpoint of step N
calls :meth:`MetricsLogger.resume_at` (N) before its first record, which drops the records of
later steps (an earlier run went past its last checkpoint and crashed or was stopped) from
``metrics.jsonl`` and opens TensorBoard with ``purge_step=N + 1``, so that TensorBoard discards
the earlier run's events from step N + 1 on. A fresh start (N = 0) in a directory that already
has a ``metrics.jsonl`` moves it aside to ``metrics.jsonl.<k>`` (k = 1, 2, ...). The trackers
follow the same rule (``pipeline.observe.trackers.TrackerSet``): a resumed run continues the same W&B /
MLflow run, a fresh start begins new ones.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from pipeline.observe.trackers import TrackerSet, build_trackers, move_aside

if TYPE_CHECKING:
    from megatron_gspo.config import Config
    from pipeline.observe.trackers import Tracker


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Append step metrics to ``<run_dir>/metrics.jsonl`` and TensorBoard (``<run_dir>/tb``), and
    hand them to the external ``trackers`` (W&B, MLflow: ``pipeline.observe.trackers``), which get each
    step at its :meth:`commit`; ``config`` (the resolved configuration) is logged to a tracker
    run when it is created.

    The files and trackers are opened at :meth:`resume_at` or, without it, at the first
    :meth:`log`."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 trackers: Sequence[Tracker] = (), config: Optional[dict] = None,
                 stream=sys.stdout):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.stream = stream
        self.tensorboard = tensorboard
        self._tb = None
        self._file = None
        self._trackers = TrackerSet(list(trackers), run_dir, config=config) if trackers else None
        self._start = time.monotonic()
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_config(cls, cfg: Config, run_dir: str | Path, *,
                    enabled: bool = True) -> MetricsLogger:
        """The logger ``cfg.run.loggers`` asks for (rank 0: ``enabled``; the others' do nothing
        and build no tracker)."""
        return cls(run_dir, enabled=enabled, tensorboard="tensorboard" in cfg.run.loggers,
                   trackers=build_trackers(cfg.run, run_dir) if enabled else (),
                   config=cfg.to_dict())

    @property
    def path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def resume_at(self, step: int) -> None:
        """The run continues after ``step`` (0: a fresh start); call it before the first
        :meth:`log`. Records of later steps are dropped from metrics.jsonl (rewritten
        atomically; a torn last line of a killed writer goes too) and TensorBoard purges its
        events from ``step + 1`` on (see the module docstring)."""
        if not self.enabled:
            return
        if self._file is not None or self._tb is not None:
            raise RuntimeError("MetricsLogger.resume_at: call it before the first log()")
        records = []
        if self.path.exists():
            if step > 0:
                kept = []
                for line in self.path.read_text().splitlines():
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue  # a line cut short when the previous run was killed
                    if isinstance(record, dict) and int(record.get("step", step + 1)) <= step:
                        kept.append(line + "\n")
                        records.append(record)
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(kept))
                os.replace(tmp, self.path)
            else:
                move_aside(self.path)
        tb_dir = self.run_dir / "tb"
        if step > 0:
            purge: Optional[int] = step + 1
        else:  # a fresh start hides every event of an earlier run in this directory
            purge = 0 if tb_dir.is_dir() and any(tb_dir.iterdir()) else None
        self._open(purge_step=purge, resume_step=step, records=records)

    def _open(self, purge_step: Optional[int] = None, resume_step: Optional[int] = None,
              records: Sequence[dict] = ()) -> None:
        if self._trackers is not None:  # first: an input error in opening one stops the run here
            self._trackers.open(resume_step, list(records))
        self._file = open(self.path, "a", buffering=1)
        if self.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is a dependency; keep JSONL working without it
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, Any], *, progress: Optional[str] = None) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self._open()
        record = {"step": step, "time_s": round(time.monotonic() - self._start, 3)}
        record.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._trackers is not None:
            self._trackers.add(step, record)
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if progress:
            print(progress, file=self.stream, flush=True)

    def commit(self, step: int) -> None:
        """The steps <= ``step`` can no longer be re-run (their checkpoint is written, or the run
        ended): send them to the trackers. Called on every rank after each checkpoint."""
        if self.enabled and self._trackers is not None and self._file is not None:
            self._trackers.commit(step)

    def close(self) -> None:
        """Close the files and end the trackers' runs; steps logged after the last
        :meth:`commit` stay in metrics.jsonl only (a resumed run redoes them)."""
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._trackers is not None and self._file is not None:
            self._trackers.close()
            self._trackers = None  # closed once; a later commit or close does nothing


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All records of ``metrics.jsonl``, one per step: records of the same step are merged key by
    key, a later value winning (a resumed run rewrites the steps after its checkpoint)."""
    records: dict[int, dict] = {}
    with open(Path(run_dir) / "metrics.jsonl") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                records.setdefault(record["step"], {}).update(record)
    return [records[k] for k in sorted(records)]
