"""Run metrics a person can read and plot: one JSON object per step in ``metrics.jsonl``, the same
scalars in TensorBoard (``tb/``), and a one-line progress report per step on stdout.

Only one process (global rank 0) writes; the others get a logger whose methods do nothing.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    """Append step metrics to ``<run_dir>/metrics.jsonl`` and TensorBoard."""

    def __init__(self, run_dir: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 stream=sys.stdout):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.stream = stream
        self._tb = None
        self._file = None
        self._start = time.monotonic()
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is a dependency; keep JSONL working without it
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any], *, progress: Optional[str] = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time_s": round(time.monotonic() - self._start, 3)}
        record.update({k: _plain(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, step)
        if progress:
            print(progress, file=self.stream, flush=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


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
